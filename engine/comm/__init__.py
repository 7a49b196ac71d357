"""Collectives among engine ranks (`HostComm`), whether the ranks are threads or processes."""

from .host_comm import CommAborted, HostComm, RedOp
from .thread_comm import ThreadComm

__all__ = ["CommAborted", "HostComm", "RedOp", "ThreadComm"]
