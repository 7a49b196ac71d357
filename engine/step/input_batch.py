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
    along: its position the kept step's length; its slot the next of its block, or at a block's start the first
    of the block the scheduler has just given it; its input the token the kept step drew for it, read by the
    host or still on the device; its table, sampling row and place among the draws the kept step's (the same
    lists). Which rows start a block, and which fill one, at a step of the run is known from where each stood at
    its first: the rows bucketed by their position within a block then, read in turn, so that only those rows
    (one in block_size) are looked at. Each sequence is moved past the step as `ModelRunner.plan` does: a token
    computed and a draw pending, at its row (the same as before).

    List passes in Python, not array operations: 256 rows cost a few numpy calls' time, and on a CPU, whose
    forward has just evicted numpy's code and data from the caches, each such call costs tens of microseconds.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._batch: list[Sequence] = []  # the kept step's sequences in row order; [] where none is kept
        self._rows: list[SampleRow] = []  # their sampling rows
        self._tables: list[list[int]] = []  # their block tables
        self._slots: list[int] = []  # their slots
        self._lengths: list[int] = []  # their lengths: the next step's positions
        # The run's rows by where their length stood within a block at its first followed step, and the steps
        # followed since (`follow`); None until a step follows the kept one
        self._buckets: list[list[int]] | None = None
        self._steps = 0
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
        self._slots, self._lengths, self._buckets = plan.slots, plan.decode_lengths, None
        if len(self._order) != rows:
            self._order = list(range(rows))
        self._pending = None

    def forget(self) -> None:
        """Keep no step (its sequences, requests and draws are let go): the loop's sequences all ended."""
        self._batch, self._rows, self._tables, self._draws, self._buckets = [], [], [], None, None

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
            input_ids = [0] * n
        else:
            read = self._draws.known
            if read is None:
                return None
            input_ids = read.token_ids
        if pending != self._pending:  # what the rows hold of their draws pending, as `Sequence.sample_row` sets it
            for seq, row in zip(batch, self._rows):
                row.num_pending = seq.num_pending
            self._pending = pending
        bs = self.block_size
        if self._buckets is None:  # the run's first followed step
            self._buckets, self._steps = [[] for _ in range(bs)], 0
            for i, length in enumerate(self._lengths):
                self._buckets[length % bs].append(i)
        step, positions = self._steps, self._lengths
        lengths = [p + 1 for p in positions]
        slots = [s + 1 for s in self._slots]
        growth: list[tuple[int, int, int]] = []
        for i in self._buckets[-step % bs]:  # the rows whose position starts a block: a block just given
            j = positions[i] // bs
            block = batch[i].block_table[j]
            growth.append((i, j, block))
            slots[i] = block * bs
        filled = [batch[i] for i in self._buckets[(-step - 1) % bs]]  # the rows whose token ends a block
        for seq in batch:
            seq.num_computed += 1
            seq.num_pending += 1
        self._slots, self._lengths, self._steps, self._draws = slots, lengths, step + 1, None
        return StepPlan(
            input_ids,
            positions,
            slots,
            order,
            self._tables,
            lengths,
            pending_in_order=pending,
            table_growth=growth,
            sample_rows=self._rows,
            samplers=self._batch,
            filled=filled,
        )
