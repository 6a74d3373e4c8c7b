"""A child process's link to the ``rsrv node`` supervisor that started it: status
reports up, and a graceful stop when the supervisor dies (see ``_lifeline``)."""

from rsrv.lifeline._lifeline import LINK_FD_VARIABLE, ChildStatus, SupervisorLink, read_status

__all__ = ["LINK_FD_VARIABLE", "ChildStatus", "SupervisorLink", "read_status"]
