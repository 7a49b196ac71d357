"""A steady decode step's plan from the step before's (vLLM's persistent input batch)."""

from __future__ import annotations

import operator

from .plan import StepPlan
from ..sampling.sampler import SampleFuture, SampleRow
from ..scheduling.sequence import Sequence

_banning = operator.attrgetter("params.min_new_tokens")


class InputBatch:
    """The last step's per-row inputs, kept, which the next step's follow where they can. Owned by a model
    runner, on its loop's thread.

    A step is kept (`hold`) where the next could follow it: decodes only, each drawing one token of its own in
    row order (no samples forked, no grammar, no min_new_tokens, below which a row's banned ids change from
    step to step). The next step follows it (`follow`) where the scheduler found nothing but decodes (no prefill, no
    admission, no preemption, no block copied on write: `Scheduler.decodes_only`), the same sequences in the
    same order (the same objects), with the kept step's draws launched. Then each sequence is one token further
    along: its slot the next of its block, or at a block's start the first of the block the scheduler has just
    given it (one sequence in block_size reads its table); its input the token the kept step drew for it, read
    by the host or still on the device; its table, sampling row and place among the draws the kept step's (the
    same lists). Its plan is made in one short pass that also moves each sequence past the step, as
    `ModelRunner.plan` does: a token computed and a draw pending, at its row (the same as before).

    A pass in Python, not array operations: 256 rows cost a few numpy calls' time, and on a CPU, whose forward
    has just evicted numpy's code and data from the caches, each such call costs tens of microseconds.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._batch: list[Sequence] = []  # the kept step's sequences in row order; [] where none is kept
        self._rows: list[SampleRow] = []  # their sampling rows
        self._tables: list[list[int]] = []  # their block tables
        self._slots: list[int] = []  # their slots
        self._order: list[int] = []  # 0 .. rows - 1: each row's draw is its own
        self._pending: bool | None = None  # whether the rows say a draw is pending (all, or none); None: unknown
        self._draws: SampleFuture | None = None  # the kept step's draws, once launched (`drew`)

    def hold(self, plan: StepPlan) -> None:
        """Keep the step of `plan` (made row by row) where the next could follow it; else none."""
        self._batch, self._draws = [], None
        rows = len(plan.input_ids)
        if (
            not rows
            or plan.prefills
            or len(plan.samplers) != rows
            or plan.constrained
            or any(map(_banning, plan.samplers))
        ):
            return
        self._batch, self._rows, self._tables = plan.samplers, plan.sample_rows, plan.decode_tables
        self._slots = list(plan.slots)
        if len(self._order) != rows:
            self._order = list(range(rows))
        self._pending = None

    def forget(self) -> None:
        """Keep no step (its sequences, requests and draws are let go): the loop's sequences all ended."""
        self._batch, self._rows, self._tables, self._draws = [], [], [], None

    def drew(self, draws: SampleFuture) -> None:
        """The kept step's draws, launched: the next step's inputs."""
        if self._batch:
            self._draws = draws

    def follow(self, batch: list[Sequence], pending: bool) -> StepPlan | None:
        """The plan of a step of decodes only, none copying a block, that follows the kept step; None where it
        does not (the caller plans row by row). `pending`: whether the kept step's draws are still on the
        device (overlap), else read."""
        n = len(batch)
        if self._draws is None or n != len(self._batch) or not all(map(operator.is_, batch, self._batch)):
            return None
        order = self._order
        input_ids: list[int]
        if pending:  # each row's input is its own draw of the kept step, put in on the device
            input_ids, pending_inputs = [0] * n, list(zip(order, order))
        else:
            read = self._draws.known
            if read is None:
                return None
            input_ids, pending_inputs = read.token_ids, []
        if pending != self._pending:  # what the rows hold of their draws pending, as `Sequence.sample_row` sets it
            for seq, row in zip(batch, self._rows):
                row.num_pending = seq.num_pending
            self._pending = pending
        bs = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        lengths: list[int] = []
        filled: list[Sequence] = []
        growth: list[tuple[int, int, int]] = []
        for i, (seq, slot) in enumerate(zip(batch, self._slots)):
            position = seq.num_computed
            seq.num_computed = end = position + 1
            seq.num_pending += 1
            if position % bs:
                slots.append(slot + 1)
            else:  # the first of a block the scheduler has just given it
                block = seq.block_table[position // bs]
                growth.append((i, position // bs, block))
                slots.append(block * bs)
            positions.append(position)
            lengths.append(end)
            if end % bs == 0:
                filled.append(seq)
        self._slots, self._draws = slots, None
        return StepPlan(
            input_ids,
            positions,
            slots,
            order,
            self._tables,
            lengths,
            pending_inputs=pending_inputs,
            table_growth=growth,
            sample_rows=self._rows,
            samplers=self._batch,
            filled=filled,
        )
