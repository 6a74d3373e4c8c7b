"""The ``rsrv`` command line: ``serve``, ``node``, ``gateway``, ``bundle check``, ``export``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import rsrv


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] in (["serve"], ["gateway"]):  # (a server: see rsrv.lifeline, first thing)
        from rsrv.lifeline import hold_stop_signals

        hold_stop_signals()
    parser = argparse.ArgumentParser(
        prog="rsrv",
        description="rsrv: serve compiled models (StableHLO on PJRT) over KServe V2 / Triton "
        "gRPC: a worker, a node of workers, a gateway; check and export bundles.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {rsrv.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a worker: gRPC KServe V2 on the node's port")
    serve.add_argument(
        "node_file",
        nargs="?",
        help="node file (YAML or TOML); default: the built-in CPU node serving ./bundles on "
        "127.0.0.1:8001, or, when there is no ./bundles directory and rsrv runs from a "
        "source checkout, that checkout's example bundles (the log says which)",
    )
    serve.add_argument("--worker", help="which worker of the node file to run")

    node = sub.add_parser(
        "node",
        help="run every worker of a node, one process per device (specs/node.md); "
        "`rsrv node status [NODE_FILE]` asks a running node how it is",
    )
    node.add_argument(
        "node_args",
        nargs="*",
        metavar="[status] [NODE_FILE]",
        help="node file (YAML or TOML); default: the built-in node, as for serve",
    )

    gateway = sub.add_parser(
        "gateway",
        help="run a gateway: one gRPC endpoint in front of workers (specs/gateway.md); "
        "`rsrv gateway status|repack|set-replicas|set-policy` steer a running one",
    )
    gateway.add_argument(
        "gateway_args",
        nargs="*",
        metavar="GATEWAY_FILE | COMMAND ARGS",
        help="gateway file (YAML or TOML; default: INFERENCE_GATEWAY_* variables only), or "
        "status | repack [--wait S] | set-replicas MODEL N|all|default | set-policy K=V ...",
    )
    from rsrv.gateway import add_ctl_arguments

    add_ctl_arguments(gateway)

    bundle = sub.add_parser("bundle", help="bundle tools")
    bundle_sub = bundle.add_subparsers(dest="bundle_command", required=True)
    check = bundle_sub.add_parser("check", help="validate and compile bundles")
    check.add_argument(
        "dirs", nargs="+", type=Path, help="bundle directories, or repositories holding bundles"
    )

    export = sub.add_parser(
        "export", help="export a JAX / Flax / Equinox / PyTorch model to a bundle (specs/export.md)"
    )
    from rsrv.export import add_arguments

    add_arguments(export)

    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except BrokenPipeError:
        # The reader of stdout went away (`rsrv bundle check ... | head`): what is left
        # has nowhere to go. Point stdout at /dev/null so that the exit's flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "node":
        from rsrv.node import node_main, status_main

        rest = list(args.node_args)
        command = node_main
        if rest and rest[0] == "status":
            command = status_main
            rest.pop(0)
        if len(rest) > 1:
            parser.error("node: give at most one node file")
        return command(rest[0] if rest else None)
    if args.command == "gateway":
        from rsrv.gateway import COMMANDS, CTL_OPTIONS, ctl_main, gateway_main
        from rsrv.lifeline import release_stop_signals

        rest = list(args.gateway_args)
        if rest and rest[0] in COMMANDS:  # (a client of one: Python's own signals)
            release_stop_signals()
            return ctl_main(rest[0], rest[1:], args)
        if len(rest) > 1:
            parser.error("gateway: give at most one gateway file")
        given = [f"--{o.replace('_', '-')}" for o in CTL_OPTIONS if vars(args)[o] != CTL_OPTIONS[o]]
        if given:  # (silently ignored, a mistyped command would look like it worked)
            parser.error(
                f"gateway: {', '.join(given)}: options of the commands ({', '.join(COMMANDS)}), "
                "not of running a gateway"
            )
        return gateway_main(rest[0] if rest else None)
    if args.command == "serve":
        from rsrv.worker import serve_main

        return serve_main(args.node_file, args.worker)
    if args.command == "bundle":
        from rsrv.bundle_check import check_main

        return check_main(args.dirs)
    if args.command == "export":
        from rsrv.export import export_main

        return export_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
