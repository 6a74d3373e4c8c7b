"""``rsrv gateway status | repack | set-replicas | set-policy``: the gateway's control
service from the command line.

Each subcommand makes one call to ``--address`` (default 127.0.0.1:8001) and prints
the answer; exit status 0 on success, 1 when the gateway refused (its status and
message are printed), 2 when it cannot be reached or the command line is malformed (a
bad address, a value of the wrong type).
"""

from __future__ import annotations

import argparse
import ssl
import sys

import trio
from google.protobuf import json_format
from purerpc.grpclib.status import StatusCode

from rsrv.config import parse_env_value, split_address
from rsrv.protocol.generated.rsrv.gateway.v1 import gateway_pb2 as pb
from rsrv.transport import TLS_ERRORS, client_tls_context, metadata_problem, open_channel

__all__ = ["COMMANDS", "CTL_OPTIONS", "add_ctl_arguments", "ctl_main"]

SERVICE = "/rsrv.gateway.v1.GatewayControl/"
COMMANDS = ("status", "repack", "set-replicas", "set-policy")


#: The options of the commands that steer a running gateway, and their defaults.
CTL_OPTIONS = {
    "address": "127.0.0.1:8001",
    "wait": 0.0,
    "fill_mode": "",
    "fill_factor": None,
    "allow_unknown": False,
    "header": [],
    "tls_ca_file": None,
    "tls_cert_file": None,
    "tls_key_file": None,
}


def add_ctl_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=CTL_OPTIONS["address"], help="the gateway, host:port")
    parser.add_argument(
        "--wait", type=float, default=CTL_OPTIONS["wait"], help="repack: seconds to wait"
    )
    parser.add_argument(
        "--fill-mode",
        default=CTL_OPTIONS["fill_mode"],
        help="set-replicas: run|spread|inflight|inherit",
    )
    parser.add_argument("--fill-factor", type=float, help="set-replicas: rows per run / max batch")
    parser.add_argument(
        "--allow-unknown", action="store_true", help="set-replicas: a model no worker serves yet"
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a header on the call (repeatable): the key of a restricted gateway-control",
    )
    parser.add_argument("--tls-ca-file", help="call over TLS: the CA of the gateway's certificate")
    parser.add_argument("--tls-cert-file", help="with --tls-key-file: a client certificate")
    parser.add_argument("--tls-key-file", help="the key of --tls-cert-file")


#: The options only one command takes (the others' are every command's).
_OWN_OPTIONS = {
    "wait": "repack",
    "fill_mode": "set-replicas",
    "fill_factor": "set-replicas",
    "allow_unknown": "set-replicas",
}


def _request(command: str, args: list[str], options: argparse.Namespace):
    for option, owner in _OWN_OPTIONS.items():
        given = getattr(options, option, CTL_OPTIONS[option])
        if owner != command and given != CTL_OPTIONS[option]:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} is an option of {owner}, not of {command}")
    if command in ("status", "repack") and args:
        wait = " (the time to wait is --wait S)" if command == "repack" else ""
        raise ValueError(f"{command} takes no arguments, not {' '.join(args)!r}{wait}")
    if command == "status":
        return "GetSchedulingStatus", pb.GetSchedulingStatusRequest(), pb.SchedulingStatus
    if command == "repack":
        return "Repack", pb.RepackRequest(wait_seconds=options.wait), pb.RepackResponse
    if command == "set-replicas":
        if len(args) != 2:
            raise ValueError("set-replicas MODEL N|all|default")
        model, count = args
        request = pb.SetModelPlacementRequest(
            name=model, fill_mode=options.fill_mode, allow_unknown_model=options.allow_unknown
        )
        special = {"all": -1, "default": 0}
        if count not in special and not (count.isascii() and count.isdigit() and int(count) >= 1):
            raise ValueError(f"set-replicas: {count!r}: expected N (1 or more), all or default")
        request.replicas = special[count] if count in special else int(count)
        if options.fill_factor is not None:
            request.fill_factor = options.fill_factor
        return "SetModelPlacement", request, pb.SetModelPlacementResponse
    # set-policy key=value ...
    if not args:
        raise ValueError("set-policy KEY=VALUE ...")
    policy, mask = {}, []
    for item in args:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected KEY=VALUE")
        policy[key] = value
        mask.append(key)
    message = pb.SchedulingPolicy()
    known = message.DESCRIPTOR.fields_by_name
    try:  # an unknown key goes in the mask alone: the gateway names what is wrong with it
        values = {k: _typed(message, k, v) for k, v in policy.items() if k in known}
        json_format.ParseDict(values, message)
    except (json_format.ParseError, ValueError) as e:
        raise ValueError(str(e)) from None
    return (
        "SetSchedulingPolicy",
        pb.SetSchedulingPolicyRequest(update_mask=mask, policy=message),
        pb.SetSchedulingPolicyResponse,
    )


def _typed(message, key: str, value: str):
    """``value`` as the type of ``message``'s field ``key``, parsed as the environment's
    values are (rsrv.config.parse_env_value). Raises ValueError naming the key."""
    field = message.DESCRIPTOR.fields_by_name[key]
    if field.type == field.TYPE_BOOL:
        try:
            return parse_env_value(value, bool)
        except ValueError:
            raise ValueError(
                f"{key}={value!r}: expected true or false (1/0, yes/no, on/off)"
            ) from None
    if field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        try:
            return parse_env_value(value, float)
        except ValueError as e:
            raise ValueError(f"{key}={value!r}: {e}") from None
    if field.type in (field.TYPE_INT32, field.TYPE_UINT32, field.TYPE_INT64, field.TYPE_UINT64):
        try:
            return -1 if value == "all" else int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected an integer") from None
    return value


def _headers(items: list[str]) -> list[tuple[str, str]]:
    """``--header NAME=VALUE`` items as call metadata; ValueError naming a bad one."""
    headers = []
    for n, item in enumerate(items, 1):
        name, sep, value = item.partition("=")
        problem = "expected NAME=VALUE" if not sep else metadata_problem(name, value)
        if problem is not None:  # (the item, never: its value is a key)
            raise ValueError(f"--header #{n}: {problem}")
        headers.append((name, value))
    return headers


def _tls(options: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS context of ``--tls-*`` (None: plain); ValueError naming what is wrong."""
    ca, cert, key = options.tls_ca_file, options.tls_cert_file, options.tls_key_file
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    if ca is None:
        if cert is not None:
            raise ValueError("--tls-cert-file needs --tls-ca-file")
        return None
    try:
        return client_tls_context(ca, cert, key)
    except TLS_ERRORS as e:
        raise ValueError(f"cannot use the TLS files: {getattr(e, 'strerror', None) or e}") from None


async def _call(host: str, port: int, method: str, request, headers, tls):
    async with open_channel(host, port, tls=tls) as channel:
        return await channel.unary(
            SERVICE + method, request.SerializeToString(), metadata=headers, timeout=130
        )


def ctl_main(command: str, args: list[str], options: argparse.Namespace) -> int:
    try:
        host, port = split_address(options.address)
        method, request, response_type = _request(command, args, options)
        headers = _headers(options.header)
        tls = _tls(options)
    except ValueError as e:
        print(f"rsrv gateway {command}: {e}", file=sys.stderr)
        return 2
    result = trio.run(_call, host, port, method, request, headers, tls)
    if result.status != StatusCode.OK:
        print(f"rsrv gateway {command}: {result.status.name}: {result.message}", file=sys.stderr)
        return 2 if not result.reached_server else 1
    answer = response_type.FromString(result.response or b"")
    # every field, false and zero included: scripts read keys such as "ready"
    text = json_format.MessageToJson(
        answer,
        preserving_proto_field_name=True,
        indent=1,
        always_print_fields_with_no_presence=True,
    )
    print(text)
    return 0
