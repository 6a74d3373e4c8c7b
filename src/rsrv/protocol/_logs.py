"""Triton's LogSettings mapped onto Python logging for the ``rsrv`` logger tree."""

from __future__ import annotations

import logging

from rsrv.errors import InvalidArgument
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

_BOOL = ("log_info", "log_warning", "log_error")


class LogSettings:
    """Report and accept Triton's log settings; they drive the ``rsrv`` logger's level."""

    def __init__(self, level: str = "info", fmt: str = "text"):
        self.values: dict[str, bool | int | str] = {
            "log_file": "",
            "log_info": level in ("debug", "info"),
            "log_warning": level != "error",
            "log_error": True,
            "log_verbose_level": 1 if level == "debug" else 0,
            "log_format": "default" if fmt == "text" else "json",
        }
        self._apply()

    def update(self, key: str, setting) -> None:
        kind = setting.WhichOneof("parameter_choice")
        value = getattr(setting, kind) if kind else None
        expected = {
            "log_verbose_level": "uint32_param",
            "log_format": "string_param",
            "log_file": "string_param",
        }.get(key, "bool_param" if key in _BOOL else None)
        if expected is None:
            raise InvalidArgument(f"unknown log setting {key!r} (known: {', '.join(self.values)})")
        if kind != expected:
            raise InvalidArgument(f"log setting {key!r} takes a {expected.split('_')[0]} value")
        if key == "log_file" and value:
            raise InvalidArgument("log_file is not supported: rsrv logs to stderr")
        if key == "log_format" and value != self.values["log_format"]:
            raise InvalidArgument(
                f"log_format is {self.values['log_format']!r}, fixed at start "
                "(logging.format in the node file)"
            )
        self.values[key] = value
        self._apply()

    def _apply(self) -> None:
        v = self.values
        level = (
            logging.DEBUG
            if v["log_verbose_level"]
            else logging.INFO
            if v["log_info"]
            else logging.WARNING
            if v["log_warning"]
            else logging.ERROR
            if v["log_error"]
            else logging.CRITICAL + 1
        )
        logging.getLogger("rsrv").setLevel(level)

    def to_proto(self) -> dict:
        out = {}
        for key, value in self.values.items():
            if isinstance(value, bool):
                out[key] = pb.LogSettingsResponse.SettingValue(bool_param=value)
            elif isinstance(value, int):
                out[key] = pb.LogSettingsResponse.SettingValue(uint32_param=value)
            else:
                out[key] = pb.LogSettingsResponse.SettingValue(string_param=value)
        return out
