"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..models.attention import (
    AttentionMetadata,
    DecodeTables,
    GatheredDecode,
    PrefillChunk,
    PrefillTables,
    decode_mask,
    gather_rows,
)
from .block_tables import StepTables
from .cuda_graphs import DecodeGraphs
from .input_batch import InputBatch
from .kv_cache import copy_blocks
from ..machine.memory import empty_device_cache, release_host_memory
from ..models.llama import LlamaForCausalLM
from ..sampling.sampler import SampleFuture, SampleRow, SampleTable, launch_sample
from ..comm.host_comm import HostComm, RedOp
from ..errors import InternalError
from ..scheduling.sequence import Sequence
from ..machine.transfers import to_device
from .plan import PromptRows, StepPlan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInputs:
    """Device-side inputs of one step: a flat token batch, decodes first."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # the batch row of each sampling sequence's last token
    sample_rows: list[SampleRow]
    bucket: int = 0  # a decode step replayed from the CUDA graph of this batch size (cuda_graphs.py); 0: eager
    copies: tuple[torch.Tensor, torch.Tensor] | None = None  # blocks copied on write: (sources, destinations)
    prompt: PromptRows | None = None
    weight_version: str = ""  # of the model the forward ran (`LocalWeights`), set by `forward`


# How attention reads the paged cache: torch ops (gather, then matmuls), the C++ CPU attention kernels
# (engine/kernels), or the Triton kernels (engine/kernels/triton, the CUDA path).
ATTENTION_PATHS = ("torch", "cpu", "triton")


def padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [rows, longest] int64 tensor, padded with block 0: filled row by row through numpy,
    a third of the time `torch.tensor` takes over the padded lists (hundreds of rows a step)."""
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for row, table in zip(out, tables):
        row[: len(table)] = table
    return torch.from_numpy(out)


class ModelRunner:
    """Owned by one engine loop's thread, like the KV cache tensors it writes."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        make_kv_cache: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
        block_size: int,
        device: torch.device,
        attention: str,
        tables: StepTables,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model: LlamaForCausalLM | None = model  # replaced whole (updates; None asleep), read once per step
        self.weights_version = 0  # bumped by the engine with every new model, after `model` is replaced
        self.make_kv_cache = make_kv_cache
        self.kv_caches = make_kv_cache()
        self.block_size = block_size
        self.device = device
        self.attention = attention  # of ATTENTION_PATHS; chosen at build, read per step
        self.vocab_size: int | None = None  # ids a sampler may draw (the tokenizer's), where below the model's
        self._no_prefills: PrefillTables | None = None  # a decode step's prefill tables, built once
        self.tables = tables  # the decodes' block tables, kept across steps
        self.sample_table = SampleTable(2 * tables.rows + 1)  # the sampling rows' state, kept across steps
        self.inputs = InputBatch(block_size)  # a steady decode step's inputs, from the step before's
        self.graphs = graphs  # decode steps from CUDA graphs (Triton path, no tensor parallelism), else None
        self.followers: HostComm | None = None  # a tensor-parallel leader's group: what it does, they do
        self.group_kv_share = 1.0  # the tensor-parallel group's KV heads over this rank's
        # a TP leader's LocalWeights.install_staged
        self.install_weights: Callable[[int], object] = lambda version: None
        self._pending_weights: int | None = None  # the staged version to install; a leaf lock guards it
        self._pending_lock = threading.Lock()

    def release_kv_cache(self) -> None:
        self._tell_followers("release_kv")
        self.kv_caches = []
        if self.graphs is not None:
            self.graphs.drop()
        if self.device.type == "cuda":
            empty_device_cache()
        else:  # in a rank process too, not only where the Engine runs
            release_host_memory()

    def allocate_kv_cache(self) -> None:
        """Every rank of the group allocates its own; if any cannot, all free theirs again and this raises (a
        Wakeup that fails, the server still up), rather than a group with KV on some ranks only."""
        self._tell_followers("allocate_kv")
        error = self._allocate_own_kv_cache()
        if self.followers is not None and self.followers.all_reduce(int(error is not None), RedOp.MAX):
            self.release_kv_cache()
            cause = error or "see the other ranks' logs"
            raise InternalError(f"a rank of the tensor-parallel group could not allocate its KV cache: {cause}")
        if error is not None:
            raise error

    def allocate_kv_cache_as_follower(self, group: HostComm) -> None:
        """A tensor-parallel follower's side of `allocate_kv_cache`: it tells the leader whether it could."""
        group.all_reduce(int(self._allocate_own_kv_cache() is not None), RedOp.MAX)

    def _allocate_own_kv_cache(self) -> Exception | None:
        """This rank's KV cache, unless it has one; what kept it from allocating (out of memory, most likely)."""
        if not self.kv_caches:
            try:
                self.kv_caches = self.make_kv_cache()
            except Exception as exc:
                log.exception("could not allocate this rank's KV cache")
                return exc
        return None

    def stop_followers(self) -> None:
        self._tell_followers("stop")

    def switch_weights_at_next_step(self, version: int) -> None:
        """From a tensor-parallel leader's control thread, once every rank of its group staged `version`."""
        with self._pending_lock:
            self._pending_weights = version

    def install_pending_weights(self) -> None:
        """At a step boundary, on the loop thread: the staged weights go in here and at the followers at once,
        so that no step mixes old and new shards."""
        with self._pending_lock:
            version, self._pending_weights = self._pending_weights, None
        if version is not None:
            self._tell_followers("install_weights", version)
            self.install_weights(version)

    def _tell_followers(self, command: str, argument: object = None) -> None:
        if self.followers is not None:
            self.followers.broadcast((command, argument))

    @property
    def kv_cache_bytes(self) -> int:
        """This rank's KV cache; a tensor-parallel leader's counts its whole group's."""
        return int(sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv) * self.group_kv_share)

    def setup(
        self,
        batch: list[Sequence],
        drawn: torch.Tensor | None = None,
        copies: list[tuple[int, int]] | None = None,
        decodes_only: bool = False,
    ) -> tuple[StepPlan, StepInputs]:
        """kSetup + kPrepare. `drawn`: the last step's sampled ids on the device, the input of the decodes whose
        token the host has not read yet (overlap scheduling, never under tensor parallelism). `copies`: blocks
        to copy before the forward writes (copy on write; `Scheduler.copies`). `decodes_only`: the scheduler
        found decodes only (`Scheduler.decodes_only`): the plan may follow the last step's (`InputBatch`).
        A tensor-parallel leader sends the plan to its followers first."""
        plan = self.inputs.follow(batch, drawn is not None) if decodes_only and not copies else None
        if plan is None:
            plan = self.plan(batch)
            self.inputs.hold(plan)
        plan.copies = copies or []
        if self.followers is not None:
            self.followers.broadcast(("step", self._shared(plan)))
        return plan, self.prepare(plan, drawn)

    @staticmethod
    def _shared(plan: StepPlan) -> StepPlan:
        """What a tensor-parallel follower reads of the plan (not the tables' growth: its tables are other lists,
        unpickled, which `StepTables` compares)."""
        return dataclasses.replace(
            plan, sample_rows=[], samplers=[], constrained=[], filled=[], prompt=None, table_growth=None
        )

    def plan(self, batch: list[Sequence]) -> StepPlan:
        """kSetup row by row: the step as plain lists, decodes first, from the sequences' host-side state. The
        step's one pass over its sequences, so it also moves each past the step as it goes: its scheduled tokens
        count as computed, and a draw of its own (and of each sample it forks) as pending, at its row of the
        step's draws (a step that fails after this ends every sequence). The sampling sequences, and the rows of
        those with a grammar, are the plan's too."""
        plan = StepPlan()
        bs = self.block_size
        # Per sequence, hundreds a step on the host's critical path: its fields read once, no properties.
        input_ids, positions, slots = plan.input_ids, plan.positions, plan.slots
        samplers, sample_rows, filled = plan.samplers, plan.sample_rows, plan.filled
        rows = draws = 0  # the step's token rows and draws so far: len(input_ids), len(samplers)
        for seq in batch:
            start, table, token_ids = seq.num_computed, seq.block_table, seq.token_ids
            end = start + seq.num_scheduled
            num_tokens = len(token_ids) + seq.num_pending  # `Sequence.num_tokens`
            first_row = rows
            if end - start == 1 and end == num_tokens:  # a decode: one token, the last
                rows += 1
                if seq.num_pending:  # still on the device: the last step's draws fill it in there
                    plan.pending_inputs.append((first_row, seq.pending_row))
                    input_ids.append(0)
                else:
                    input_ids.append(token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                plan.decode_tables.append(table)
                plan.decode_lengths.append(end)
                if end % bs == 0:
                    filled.append(seq)
            else:
                input_ids.extend(token_ids[start:end])
                positions.extend(range(start, end))
                for j in range(start // bs, (end - 1) // bs + 1):  # a block's slots at a time, not a token's
                    base = table[j] * bs - j * bs
                    slots.extend(range(base + max(start, j * bs), base + min(end, j * bs + bs)))
                rows = len(input_ids)
                plan.prefills.append((first_row, rows, end, table[: -(-end // bs)]))
                if seq.prompt_logprobs is not None:
                    self._prompt_rows(plan, seq, start, end, first_row)
                filled.append(seq)
            seq.num_computed = end
            if end == num_tokens:  # `Sequence.samples_this_step`
                forks = seq.forks  # the request's other samples, not yet drawn: their first draws, from this row
                for drawer in (seq, *forks) if forks else (seq,):
                    plan.logit_rows.append(rows - 1)
                    if drawer.matcher is not None:
                        plan.constrained.append((draws, drawer.matcher))
                    sample_rows.append(drawer.sample_row())
                    drawer.num_pending += 1
                    drawer.pending_row = draws
                    samplers.append(drawer)
                    draws += 1
                if forks:
                    seq.forks = []
        return plan

    @staticmethod
    def _prompt_rows(plan: StepPlan, seq: Sequence, start: int, end: int, first_row: int) -> None:
        """The rows of a prefill chunk that predict a prompt token whose log-probability `seq` has not yet
        (a sequence preempted in its prompt computes it again, and keeps what it had)."""
        first, last = max(start, seq.prompt_rows_planned), min(end, seq.num_prompt_tokens - 1)
        if first >= last:
            return
        seq.prompt_rows_planned = last
        prompt = plan.prompt = plan.prompt or PromptRows()
        prompt.rows.extend(range(first_row + first - start, first_row + last - start))
        prompt.targets.extend(seq.token_ids[first + 1 : last + 1])
        prompt.top = max(prompt.top, seq.params.prompt_logprobs or 0)
        prompt.owners.append((seq, last - first))

    def prepare(self, plan: StepPlan, drawn: torch.Tensor | None = None) -> StepInputs:
        """kPrepare: the plan as device tensors and the attention metadata this runner's path reads."""
        # A graph's logits are its rows in order: not where a request's samples draw from one row (forks).
        rows = len(plan.input_ids)
        if (
            self.graphs is not None
            and len(plan.logit_rows) == rows
            and self.graphs.fits(rows, len(plan.prefills), max(map(len, plan.decode_tables), default=0))
        ):
            input_ids, positions, meta = self.graphs.load(
                plan.input_ids,
                plan.positions,
                plan.slots,
                plan.decode_tables,
                plan.decode_lengths,
                plan.pending_inputs,
                drawn,
                plan.pending_in_order,
                plan.table_growth,
            )
            # Every decode samples, in order: the logits are the bucket's first rows (only their count is read).
            return StepInputs(
                input_ids,
                positions,
                meta,
                torch.arange(len(plan.logit_rows)),
                plan.sample_rows,
                bucket=meta.num_decode,
                copies=self._copies(plan.copies),
            )
        if self.graphs is not None:
            self.graphs.store.passed_by()
        prefills: PrefillTables | list[PrefillChunk]
        if self.attention in ("triton", "cpu"):
            prefills = self._prefill_tables(plan.prefills)
        else:
            prefills = [
                PrefillChunk(start, end, context, self._rows(torch.tensor(table, dtype=torch.long)))
                for start, end, context, table in plan.prefills
            ]
        decode = self._decode_tables(plan) if plan.decode_tables else None
        meta = AttentionMetadata(
            self._tensor(plan.slots), len(plan.decode_tables), decode, prefills, triton=self.attention == "triton"
        )
        input_ids = self._tensor(plan.input_ids)
        self._fill_pending(input_ids, plan, drawn)
        return StepInputs(
            input_ids,
            self._tensor(plan.positions),
            meta,
            self._tensor(plan.logit_rows),
            plan.sample_rows,
            copies=self._copies(plan.copies),
            prompt=plan.prompt,
        )

    def _copies(self, copies: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not copies:
            return None
        sources, destinations = self._tensor(list(zip(*copies)))
        return sources, destinations

    def _fill_pending(self, input_ids: torch.Tensor, plan: StepPlan, drawn: torch.Tensor | None) -> None:
        """The decodes' input ids the host has not read, from the last step's draws, on the device."""
        if plan.pending_in_order:
            assert drawn is not None and len(drawn) >= len(input_ids), "each row's input is its draw of the last step"
            input_ids.copy_(drawn[: len(input_ids)])
        elif plan.pending_inputs:
            assert drawn is not None, "a pending input is the last step's draw"
            rows, sources = self._tensor(list(zip(*plan.pending_inputs)))
            input_ids.index_copy_(0, rows, drawn.index_select(0, sources))

    def _decode_tables(self, plan: StepPlan) -> DecodeTables | GatheredDecode:
        if plan.table_growth is not None:
            tables = self.tables.grown(plan.decode_tables, plan.table_growth)
        else:
            tables = self.tables.tables(plan.decode_tables)
        lens = torch.from_numpy(np.array(plan.decode_lengths, dtype=np.int64))
        if self.attention != "torch":
            return DecodeTables(to_device(tables, self.device), to_device(lens, self.device))
        return GatheredDecode(
            self._rows(tables),
            to_device(decode_mask(lens, tables.shape[1] * self.block_size, self.kv_caches[0][0]), self.device),
        )

    def _prefill_tables(self, prefills: list[tuple[int, int, int, list[int]]]) -> PrefillTables:
        """Rows counted from the first prefill row: the chunks follow one another after the decodes."""
        if not prefills:  # a decode step's: built once (the kernels only read it)
            if self._no_prefills is None:
                empty = torch.zeros(0, dtype=torch.long, device=self.device)
                self._no_prefills = PrefillTables(empty.view(0, 1), empty, empty, empty, 0)
            return self._no_prefills
        lens = [end - start for start, end, _, _ in prefills]
        return PrefillTables(
            to_device(padded([table for *_, table in prefills]), self.device),
            self._tensor([0, *itertools.accumulate(lens)][: len(lens)]),
            self._tensor(lens),
            self._tensor([context for _, _, context, _ in prefills]),
            max(lens, default=0),
        )

    def _rows(self, tables: torch.Tensor) -> torch.Tensor:
        kvh, num_blocks = self.kv_caches[0][0].shape[:2]
        return to_device(gather_rows(tables, kvh, num_blocks), self.device)

    def _tensor(self, values: list) -> torch.Tensor:
        """Through numpy, which reads a list of ints in a quarter of `torch.tensor`'s time."""
        return to_device(torch.from_numpy(np.array(values, dtype=np.int64)), self.device)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, logits: bool = True) -> torch.Tensor | None:
        """kForward: the model over the batch; logits only for the rows that sample, and none for a
        tensor-parallel follower (`logits=False`), whose replicated LM head would only repeat its leader's."""
        model = self.model
        assert model is not None, "no step runs while the weights are released"
        inputs.weight_version = model.weight_version
        if inputs.copies is not None:
            copy_blocks(self.kv_caches, *inputs.copies)
        if inputs.bucket and self.graphs is not None:  # every decode samples, in order: the bucket's first rows
            out = self.graphs.run(model, self.weights_version, self.kv_caches, inputs.bucket)[: len(inputs.logit_rows)]
        else:
            hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            if not logits:
                return None
            out = model.compute_logits(hidden[inputs.logit_rows])
            if inputs.prompt is not None:
                inputs.prompt.result = self._prompt_logprobs(model, hidden, inputs.prompt)
        self._mask_padding(out)
        return out

    def _mask_padding(self, logits: torch.Tensor) -> None:
        """An embedding padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens): those ids are no
        tokens, and a client could not send them back. Here, where logits are inference tensors."""
        if self.vocab_size is not None and self.vocab_size < logits.shape[-1]:
            logits[:, self.vocab_size :] = float("-inf")

    PROMPT_ROWS_AT_ONCE = 256  # prompt positions whose [rows, vocab] logits exist at once

    def _prompt_logprobs(self, model: LlamaForCausalLM, hidden: torch.Tensor, prompt: PromptRows) -> torch.Tensor:
        """Per row: the target's logprob, then the `top` most likely ids and their logprobs, in float64 (ids are
        exact there), on the host. In slices, so that a long prompt's logits never exist all at once."""
        rows, targets = self._tensor(prompt.rows), self._tensor(prompt.targets)
        parts = []
        for at in range(0, len(prompt.rows), self.PROMPT_ROWS_AT_ONCE):
            part = slice(at, at + self.PROMPT_ROWS_AT_ONCE)
            logits = model.compute_logits(hidden[rows[part]])
            self._mask_padding(logits)
            lp = torch.log_softmax(logits, dim=-1)
            top = lp.topk(prompt.top, dim=-1)
            chosen = lp.gather(1, targets[part].unsqueeze(1))
            parts.append(torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1))
        return torch.cat(parts).cpu()

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, masks: tuple[torch.Tensor, list[int]] | None = None
    ) -> SampleFuture:
        """Sampling on the model's device, queued; its `result` (kFetch) brings the ids back in one copy.
        `masks`: structured outputs' token masks of the constrained rows (`launch_sample`)."""
        plain = None
        if inputs.bucket and self.graphs is not None:  # the logits are the graph's: so may its draw be
            plain = functools.partial(self.graphs.draw, inputs.bucket)
        draws = launch_sample(logits, inputs.sample_rows, masks, self.sample_table, scratch=True, plain=plain)
        self.inputs.drew(draws)
        return draws
