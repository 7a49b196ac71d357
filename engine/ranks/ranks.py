"""`Ranks`: the engine's data-parallel ranks as the Engine sees them, whether threads or processes."""

from __future__ import annotations

import abc
import threading
from typing import Callable, Sequence

from ..step.engine_loop import LoopStats
from ..loading.pushed import host_buffer, release_kept_buffers
from ..step.weights import WeightSource
from ..gateway.gateway import Gateway
from ..gateway.request_queue import QueueEnd


class Ranks(abc.ABC):
    """Started once with the Gateway whose `queues` they serve, stopped once after `Gateway.shutdown`.

    Weight calls come from one admin caller at a time (the Engine's admin lock) and return once every rank
    has done them; `drop_weights` only after every loop has acknowledged SLEEP.
    """

    queues: Sequence[QueueEnd]  # one per rank, handed to the Gateway
    threads_per_loop: int

    def __init__(self) -> None:
        self.failure: str | None = None  # why a rank died; set once (before `_tell_listeners`), then the server stops
        self._failure_listeners: list[Callable[[str], None]] = []
        self._listeners_lock = threading.Lock()  # guards the list; a leaf, never held while calling out

    @abc.abstractmethod
    def start(self, gateway: Gateway) -> None: ...

    @abc.abstractmethod
    def stats(self) -> list[LoopStats]: ...

    @abc.abstractmethod
    def offload_weights(self) -> None: ...

    @abc.abstractmethod
    def drop_weights(self) -> None: ...

    @abc.abstractmethod
    def restore_weights(self) -> None: ...

    @abc.abstractmethod
    def load_weights(self, source: WeightSource, name: str, in_place: bool = False) -> None:
        """New weights (a checkpoint's path or pushed ones) served as weight version `name`. `in_place`: no
        step runs meanwhile (a pause, a sleep), so ranks may write them into the served model's tensors."""

    def host_buffer(self, nbytes: int) -> memoryview:
        """Host memory to receive pushed weights into, where `load_weights` takes them from without a copy."""
        return host_buffer(nbytes)

    def release_host_buffers(self) -> None:
        """Let go of the memory kept for the next push (a level-2 sleep, whose point is memory; shutdown)."""
        release_kept_buffers()

    @property
    @abc.abstractmethod
    def weights_bytes(self) -> int:
        """Bytes of weights held on the engine's device by all ranks together."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """After `Gateway.shutdown`: wait for every rank to stop, then free their memory."""

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` runs once if a rank dies (on the thread that noticed, without locks held); at once,
        on this thread, if one died already (a rank may die while its owner is still starting up)."""
        with self._listeners_lock:
            reason = self.failure
            if reason is None:
                self._failure_listeners.append(listener)
                return
        listener(reason)

    def _tell_listeners(self, reason: str) -> None:
        """Once, by whoever set `failure` (which a listener registered from now on sees), with no lock held."""
        with self._listeners_lock:
            listeners = list(self._failure_listeners)
        for listener in listeners:
            listener(reason)
