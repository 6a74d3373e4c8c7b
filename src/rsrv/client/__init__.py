"""Clients for rsrv workers. Inference uses the unmodified ``tritonclient``."""

from rsrv.client._control import ControlClient

__all__ = ["ControlClient"]
