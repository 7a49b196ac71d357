"""`ThreadRanks`: each data-parallel rank an `EngineLoop` thread of this process, all reading one model."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from ..config import EngineConfig
from ..step.engine_loop import EngineLoop, LoopStats
from ..errors import Unavailable
from ..gateway.gateway import Gateway
from ..loading.loader import Checkpoint
from ..machine.memory import release_host_memory
from ..gateway.request_queue import RequestQueue
from ..machine.threads import on_fresh_thread
from ..step.weights import LocalWeights, WeightSource, keep_quantized
from .ranks import Ranks
from ..comm.thread_comm import ThreadComm


class ThreadRanks(Ranks):
    """Shared read-only weights; each loop has its own KV cache and agrees with its peers over `ThreadComm`."""

    def __init__(
        self, config: EngineConfig, ckpt: Checkpoint, dtype: torch.dtype, max_context_length: int, threads_per_loop: int
    ) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = ckpt.tokenizer  # not the checkpoint: it holds the raw weights
        device = torch.device(config.device)
        self.weights = LocalWeights(
            ckpt,
            dtype,
            device,
            config.max_batched_tokens,
            quantized=keep_quantized(config, dtype, device),
            int8_activations=config.int8_activations,
        )
        self.max_context_length = max_context_length
        self.threads_per_loop = threads_per_loop
        self.queues = [RequestQueue(config.max_queued_requests) for _ in range(config.engine_loops)]
        self.loops: list[EngineLoop] = []
        self._threads: list[threading.Thread] = []
        self._failure_lock = threading.Lock()  # guards `failure`; a leaf
        # Held across each weight call and shutdown's drop, and guards `_shut_down`: a Wakeup or UpdateWeights
        # that raced with shutdown would load the weights again after they were freed (shutdown waits for it
        # instead). Taken under `Engine._admin_lock` or none; only leaves are taken under it.
        self._weights_lock = threading.Lock()
        self._shut_down = False

    def start(self, gateway: Gateway) -> None:
        comms = ThreadComm.create_group(self.config.engine_loops)
        self.loops = on_fresh_thread(
            lambda: [
                EngineLoop.build(
                    comm.rank,
                    comm,
                    gateway,
                    self.weights,
                    self.tokenizer,
                    self.config,
                    self.max_context_length,
                    self.threads_per_loop,
                )
                for comm in comms
            ]
        )
        self._threads = [
            threading.Thread(target=self._serve, args=(loop,), name=f"lmgate-engine-{loop.rank}", daemon=True)
            for loop in self.loops
        ]
        for t in self._threads:
            t.start()

    def _serve(self, loop: EngineLoop) -> None:
        """A loop that stops by itself (it or a peer failed) has stopped the engine: the first says why."""
        reason = loop.run()
        if reason is None:
            return
        with self._failure_lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            self._tell_listeners(reason)

    def stats(self) -> list[LoopStats]:
        return [loop.stats() for loop in self.loops]

    def offload_weights(self) -> None:
        with self._open_weights():
            self.weights.offload()

    def drop_weights(self) -> None:
        with self._open_weights():
            self.weights.drop()
            release_host_memory()  # as a rank process does: freed tensors otherwise stay resident

    def restore_weights(self) -> None:
        with self._open_weights():
            self.weights.restore()

    def load_weights(self, source: WeightSource, name: str, in_place: bool = False) -> None:
        with self._open_weights():
            self.weights.load(source, name, in_place=in_place)

    @contextlib.contextmanager
    def _open_weights(self) -> Iterator[None]:
        with self._weights_lock:
            if self._shut_down:
                raise Unavailable("the engine has shut down")
            yield

    @property
    def weights_bytes(self) -> int:
        return self.weights.nbytes

    def shutdown(self) -> None:
        for t in self._threads:
            t.join()
        for loop in self.loops:
            loop.runner.release_kv_cache()
        with self._weights_lock:  # after a weight call in flight, which would otherwise undo this
            self._shut_down = True
            self.weights.drop()
