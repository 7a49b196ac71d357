"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step of n sequences runs the graph of the smallest bucket that holds n. Its inputs go into
static buffers in one copy from pinned host memory; rows n.. of the bucket are padding that writes nowhere
that matters (token 0 at position 0, slot -1 so the Triton store skips it, 0 tokens of KV so decode attention
reads nothing), and the first n rows of the graph's static logits are the step's. Prefill and mixed steps run
eagerly. A graph holds the addresses of the weights, the KV cache and its own buffers: the runner drops the
graphs when it frees the KV cache (Sleep), and `run` captures again when the model or its version changed
(Wakeup, UpdateWeights), one bucket at a time as steps first need it. A capture that fails (out of memory)
leaves decode steps eager until the graphs are next dropped.

Block tables are not rebuilt per step: `TableStore` keeps a row per sequence, written as the sequence's
table grows, and a step gathers its rows on the device. A step's loading makes a handful of CUDA calls, not
one per row: on a GPU each call costs the host more than the bytes it moves.

Without CUDA (`capture=False`, the tests on a CPU), the same buffers and padding run eagerly at every step.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable, Sequence
import numpy as np
import torch

from ..models.attention import AttentionMetadata, DecodeTables
from ..machine.memory import DEVICE_CACHE_LOCK
from ..models.llama import LlamaForCausalLM
from ..sampling.sampler import draw_at_temperature
from .block_tables import TableStore

log = logging.getLogger(__name__)

# token ids, positions, slots, KV lengths, rows of the table store, and the rows whose token is the last step's
# draw with the draw's row (overlap): one row each
_INPUTS = 7


def buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, and max_batch_size itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    b = 8
    while b < max_batch_size:
        sizes.append(b)
        b += 8 if b < 64 else 16
    return sizes + [max_batch_size]


class DecodeGraphs:
    """Owned by one model runner, on its loop's thread."""

    def __init__(self, max_batch_size: int, max_blocks: int, device: torch.device, capture: bool = True) -> None:
        self.sizes = buckets(max_batch_size)
        self.max_blocks = max_blocks  # block-table width: a sequence at the context limit fills it
        self.capture = capture
        self.capture_failed = False  # a capture failed: eager steps until `drop` (new model, weights or KV cache)
        size = self.sizes[-1]
        # One flat int64 buffer, so that a step's per-row inputs cross to the device in a single copy; two on
        # the host, taken in turn: a step's copy may still be queued while the next step is loaded (overlap).
        # Each with its numpy view, which the host writes (a numpy call costs less than a tensor's).
        hosts = [torch.zeros(_INPUTS * size, dtype=torch.long) for _ in range(2)]
        if capture:
            hosts = [host.pin_memory() for host in hosts]
        self._hosts = [(host, host.numpy().reshape(_INPUTS, size)) for host in hosts]
        self._device = torch.zeros_like(hosts[0], device=device)
        views = self._device.view(_INPUTS, size)
        self.input_ids, self.positions, self.slots, self.lengths, self.table_rows, *self._pending = views
        self.store = TableStore(2 * size + 1, max_blocks, device, pin=capture)
        self.tables = torch.zeros(size, max_blocks, dtype=torch.long, device=device)  # the step's rows, gathered
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # `draw`'s: each row's temperature and uniform, crossing in one copy from two pinned buffers taken in
        # turn (as the inputs'); and per bucket the graph of the draw over that bucket's logits, with its tokens
        hosts = [torch.zeros(2 * size, dtype=torch.float32) for _ in range(2)]
        if capture:
            hosts = [host.pin_memory() for host in hosts]
        self._draw_hosts = [(host, host.numpy().reshape(2, size)) for host in hosts]
        self._draw_device = torch.zeros_like(hosts[0], device=device)
        self._draw_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._logits: torch.Tensor | None = None  # the last `run`'s logits, all of its bucket's rows
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self._captured_for: tuple[int, int] | None = None  # (id of the model, its weights version)
        # Captures warm up on one side stream, made once: cuBLAS keeps a workspace (32 MiB on an H100) for each
        # stream it has run on, which no empty_cache frees, so a stream per capture would pile them up.
        self._side: torch.cuda.Stream | None = None

    def fits(self, num_rows: int, num_prefills: int, table_width: int) -> bool:
        """Whether a step runs from a graph: decodes only, as many as the largest bucket, tables that fit."""
        return num_prefills == 0 and 0 < num_rows <= self.sizes[-1] and table_width <= self.max_blocks

    def bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def load(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lengths: list[int],
        pending: Sequence[tuple[int, int]] = (),
        drawn: torch.Tensor | None = None,
        pending_in_order: bool = False,
        growth: list[tuple[int, int, int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A decode step's inputs into the static buffers, padded to its bucket; returns the bucket's views.
        `pending`: (row, row of `drawn`) of each decode whose input is the last step's draw, still on the device
        (overlap); `pending_in_order`: every row's is, its own row's. `growth`: the tables are the last step's,
        these grown (`TableStore.rows_for`). One copy of the per-row inputs (a few KB), one copy and one scatter
        of the table rows written since the last step, a gather of the step's table rows and the pending ids
        put in, on the device: a handful of CUDA calls, whatever the batch. A pinned host buffer is written
        again two loads later: by then the engine has read this step's draws, so its copies have run. (A table
        row may be written while a copy of it is queued: only with entries past those the queued step reads.)"""
        n = len(input_ids)
        self._hosts.reverse()
        host, columns = self._hosts[0]
        columns.fill(0)  # padded rows: token 0 at position 0, no KV, table row 0 (zeros)
        columns[:5, :n] = (input_ids, positions, slots, lengths, self.store.rows_for(tables, growth))
        columns[2, n:] = -1  # padded rows store nothing
        if pending:
            columns[5:, : len(pending)] = np.array(pending, dtype=np.int64).T
        self._device.copy_(host, non_blocking=True)
        self.store.sync()
        b = self.bucket(n)
        torch.index_select(self.store.device, 0, self.table_rows[:b], out=self.tables[:b])
        if pending_in_order:
            assert drawn is not None and len(drawn) >= n, "each row's input is its draw of the last step"
            self.input_ids[:n].copy_(drawn[:n])
        elif pending:
            assert drawn is not None, "a pending input is the last step's draw"
            into, source = (column[: len(pending)] for column in self._pending)
            self.input_ids.index_copy_(0, into, drawn.index_select(0, source))
        return self.views(b)

    def views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata of the first b rows: what a graph of bucket b reads."""
        decode = DecodeTables(self.tables[:b], self.lengths[:b])
        meta = AttentionMetadata(self.slots[:b], b, decode, [], triton=True)
        return self.input_ids[:b], self.positions[:b], meta

    def run(
        self, model: LlamaForCausalLM, weights_version: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], b: int
    ) -> torch.Tensor:
        """Logits of all b rows of the loaded step (the caller keeps the first n), from bucket b's graph."""
        if not self.capture:
            return self._forward(model, kv_caches, b)
        if self._captured_for != (id(model), weights_version):
            self.drop()
            self._captured_for = (id(model), weights_version)
        if self.capture_failed:
            return self._forward(model, kv_caches, b)
        if b not in self._graphs:
            forward = functools.partial(self._forward, model, kv_caches, b)
            if not self._captured(self._graphs, b, lambda: self._capture(forward)):
                return forward()
        graph, logits = self._graphs[b]
        graph.replay()
        self._logits = logits
        return logits

    def draw(self, b: int, temperatures: np.ndarray, uniforms: np.ndarray) -> torch.Tensor:
        """The tokens of the rows of the last `run` (bucket b) that all draw at their temperature alone
        (`launch_sample`'s `plain`), from bucket b's graph of `draw_at_temperature`: one copy in, a replay and a
        copy out, for the few dozen launches the draw makes eagerly. Padded rows draw at temperature 1 with
        draw 0, which no row reads. The tokens are a copy: the next replay writes the graph's over."""
        n = len(uniforms)
        self._draw_hosts.reverse()
        host, columns = self._draw_hosts[0]
        columns[0, :n], columns[1, :n] = temperatures, uniforms
        columns[0, n:], columns[1, n:] = 1.0, 0.0
        self._draw_device.copy_(host, non_blocking=True)
        if not self.capture or self.capture_failed:
            return self._draw(b)[:n]
        if b not in self._draw_graphs:
            draw, warm_up = functools.partial(self._draw, b), functools.partial(self._draw, b, copy=True)
            if not self._captured(self._draw_graphs, b, lambda: self._capture(draw, warm_up)):
                return draw()[:n]
        graph, tokens = self._draw_graphs[b]
        graph.replay()
        return tokens[:n].clone()

    def drop(self) -> None:
        """Forget every graph and its memory pool (the caller empties the allocator's cache)."""
        self._graphs.clear()
        self._draw_graphs.clear()
        self._logits = None
        self._pool = None
        self._captured_for = None
        self.capture_failed = False

    def _captured(self, into: dict, b: int, capture: Callable[[], tuple[torch.cuda.CUDAGraph, torch.Tensor]]) -> bool:
        """`capture()` into `into[b]`; False where it failed (out of memory, say: slower steps, but steps), and
        every graph is forgotten until the model, its weights or the KV cache change."""
        stream = torch.cuda.current_stream() if self._device.is_cuda else None
        try:
            with DEVICE_CACHE_LOCK:
                into[b] = capture()
            return True
        except Exception:
            log.exception(
                "capturing a CUDA graph of %d rows failed; decode steps run eagerly until the model, its weights "
                "or the KV cache change",
                b,
            )
            if stream is not None:  # a capture that failed to end leaves its thread on the capture stream
                torch.cuda.set_stream(stream)
            self._graphs.clear()
            self._draw_graphs.clear()
            self.capture_failed = True
            return False

    def _forward(self, model: LlamaForCausalLM, kv_caches, b: int) -> torch.Tensor:
        input_ids, positions, meta = self.views(b)
        self._logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
        return self._logits

    def _draw(self, b: int, copy: bool = False) -> torch.Tensor:
        """`draw_at_temperature` over the last run's logits (`copy`: over a copy of them, which it divides in
        place instead: a capture's warm-up, whose step is drawn by the replay), with `draw`'s temperatures and
        uniforms of its b rows."""
        assert self._logits is not None and len(self._logits) == b, "a draw follows its bucket's run"
        temps, uniforms = self._draw_device.view(2, -1)[:, :b].unsqueeze(2)
        return draw_at_temperature(self._logits.clone() if copy else self._logits, temps, uniforms)

    def _capture(
        self, body: Callable[[], torch.Tensor], warm_up: Callable[[], object] | None = None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of `body` and its output. One eager run on a side stream first (`warm_up`, else `body`:
        Triton compiles there, and a forward's KV is written, which the replay writes again), then the
        capture. Graphs share one memory pool: they never run at the same time."""
        side = self._side = self._side or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (warm_up or body)()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine loop's thread may run steps while this one captures (not capture:
        # the caller holds DEVICE_CACHE_LOCK). Inference mode: a draw divides the forward's logits in place.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = body()
        self._pool = graph.pool()
        return graph, out
