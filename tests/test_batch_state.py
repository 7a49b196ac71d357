"""The per-row state a loop keeps across steps instead of building it from its sequences each step: the
sampler's table (`SampleTable`), checked at every draw against a table built from that draw's rows alone, the
decodes' block tables (`StepTables`) against the lists, the steady decode step's inputs (`InputBatch`) against
the plan made row by row from the sequences, and the scheduler's batch (a steady decode step returns its decodes
as found) against the order rebuilt from the running sequences: through joins, leaves, cancels, preemptions,
forks and slots recycled."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.sampling.sampler import SampleRow, SampleTable, SamplingParams, launch_sample, sample
from lmgate.engine.scheduling.scheduler import Scheduler
from lmgate.engine.step.block_tables import StepTables
from lmgate.engine.step.engine_loop import EngineLoop
from lmgate.engine.step.input_batch import InputBatch
from lmgate.engine.step.model_runner import ModelRunner
from lmgate.engine.step.plan import StepPlan
from tests.test_engine import assert_idle

KINDS = [
    dict(),
    dict(temperature=0.8),
    dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02),
    dict(logprobs=2),
    dict(temperature=1.0, logprobs=1, logprobs_mode="processed"),
    dict(repetition_penalty=1.3, frequency_penalty=0.5, temperature=0.7),
    dict(min_new_tokens=6, temperature=1.0),
    dict(n=3, temperature=0.9),
    dict(logit_bias=((5, 3.0),)),
]


def requests(seed: int, count: int) -> list[tuple[list[int], SamplingParams, bool]]:
    """(prompt, params, cancel it after its first output): prompts of 1..40 ids, every kind of sampling."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))],
            SamplingParams(max_new_tokens=rng.randint(6, 24), ignore_eos=True, seed=rng.randrange(1000), **kind),
            rng.random() < 0.15,
        )
        for kind in (rng.choice(KINDS) for _ in range(count))
    ]


def test_a_kept_table_draws_what_a_table_per_draw_draws():
    """Rows of every kind of sampling drawn in random subsets over 2,000 calls (the last call's rows again, as a
    steady step draws; a row twice in one call now and then), each draw appended to its row as a loop does: one table kept throughout, with 4 slots to start,
    gives every call the tokens of a table built for that call; rows that stopped drawing give their slots
    back, and the table grows only as far as one call needs."""
    rng = random.Random(0)
    pool = [SampleRow(SamplingParams(**rng.choice(KINDS)), rng.randrange(2**64), [1, 2, 3], 3) for _ in range(40)]
    table = SampleTable(4)
    distinct: list[SampleRow] = []
    for call in range(2000):
        live = pool[call // 100 : call // 100 + 12]  # rows come and go
        if rng.random() > 0.3 or not all(any(r is x for x in live) for r in distinct):  # else the last rows again
            distinct = rng.sample(live, rng.randint(1, 8))
        rows = distinct + distinct[:1] if rng.random() < 0.05 else list(distinct)
        logits = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(call)) * 3
        tokens = launch_sample(logits, rows, table=table).result().token_ids
        assert tokens == sample(logits, rows).token_ids
        for row, token in zip(distinct, tokens):
            row.token_ids.append(token)
    assert table.capacity == 8


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_kept_state_holds_what_one_built_from_each_steps_sequences_holds(tiny_models, monkeypatch, overlap):
    """Requests of every kind of sampling, some cancelled, through a batch of 6 and a KV cache small enough to
    preempt: at every draw, each row's parameters, seed and draw counter in the runner's table are those a new
    table reads from the rows themselves. Many more rows pass than the table has slots. At every step, the
    gathered block tables are the decodes' lists, zero-padded, and the batch is the running sequences that
    were scheduled, decodes first, each in running order. Every plan that follows the step before's is the plan
    made row by row from the sequences, and leaves them as that one does; every update that takes a step's
    tokens as plain leaves the sequences and the outputs as the row-by-row update does."""
    kept = SampleTable.draw
    seen: set[int] = set()
    draws = 0
    schedule, step_tables, grown, follow = Scheduler.schedule, StepTables.tables, StepTables.grown, InputBatch.follow
    plain_tokens = EngineLoop._plain_tokens
    # steps of decodes only; of those, steps whose plan followed the step before's; schedules from a calendar;
    # updates whose tokens were all plain
    steady = followed = calendared = plain = 0

    def checked_plain_tokens(loop: EngineLoop, samplers: list, batch) -> bool:
        """Where a step's tokens are taken as plain, the row-by-row update does the same from the same state."""
        nonlocal plain
        before, signals = [(s.num_pending, len(s.token_ids)) for s in samplers], len(loop._signals)
        if not plain_tokens(loop, samplers, batch):
            return False
        plain += 1
        after, sent = [(s.num_pending, list(s.token_ids)) for s in samplers], loop._signals[signals:]
        for seq, (num_pending, num_tokens) in zip(samplers, before):
            seq.num_pending = num_pending
            del seq.token_ids[num_tokens:]
        del loop._signals[signals:]
        loop._update_rows(samplers, batch)
        assert [(s.num_pending, list(s.token_ids)) for s in samplers] == after
        assert not batch.finished and all(s.unsent is None and s.finish_reason is None for s in samplers)
        assert [(id(r), *rest) for r, *rest in loop._signals[signals:]] == [(id(r), *rest) for r, *rest in sent]
        return True

    def checked_follow(inputs: InputBatch, batch: list, pending: bool) -> StepPlan | None:
        nonlocal followed
        before = [(s.num_computed, s.num_pending, s.pending_row) for s in batch]
        plan = follow(inputs, batch, pending)
        if plan is None:
            return None
        followed += 1
        after = [(s.num_computed, s.num_pending, s.pending_row) for s in batch]
        rows_after = [(r.num_pending, r.banned_ids) for r in plan.sample_rows]
        for seq, (computed, num_pending, pending_row) in zip(batch, before):
            seq.num_computed, seq.num_pending, seq.pending_row = computed, num_pending, pending_row
        runner = SimpleNamespace(block_size=inputs.block_size, _prompt_rows=ModelRunner._prompt_rows)
        reference = ModelRunner.plan(runner, batch)  # type: ignore[arg-type]
        assert [(s.num_computed, s.num_pending, s.pending_row) for s in batch] == after
        assert [(r.num_pending, r.banned_ids) for r in reference.sample_rows] == rows_after
        for name in ("input_ids", "positions", "slots", "logit_rows", "decode_lengths"):
            assert list(map(int, getattr(plan, name))) == getattr(reference, name), name
        in_order = [(row, row) for row in range(len(batch))] if plan.pending_in_order else []
        assert [tuple(map(int, pair)) for pair in plan.pending_inputs] + in_order == reference.pending_inputs
        for name in ("decode_tables", "sample_rows", "samplers", "filled"):
            assert [id(x) for x in getattr(plan, name)] == [id(x) for x in getattr(reference, name)], name
        assert not reference.prefills and not reference.constrained and reference.prompt is None
        bs = inputs.block_size
        gained = [
            (i, p // bs, t[p // bs]) for i, (p, t) in enumerate(zip(plan.positions, plan.decode_tables)) if not p % bs
        ]
        assert plan.table_growth == gained
        return plan

    def checked_schedule(scheduler: Scheduler) -> list:
        nonlocal steady, calendared
        calendared += scheduler._calendar is not None
        batch = schedule(scheduler)
        if scheduler.decodes_only:  # those due a token, as `_decodes_and_prefills` finds them, each with room
            due = [
                s
                for s in scheduler.running
                if s.num_uncomputed == 1
                and s.num_tokens - s.num_prompt_tokens < s.max_new_tokens
                and not (s.num_pending and s.matcher is not None)
            ]
            assert [id(s) for s in batch] == [id(s) for s in due]
            assert all(s.num_computed < len(s.block_table) * scheduler.blocks.block_size for s in batch)
        scheduled = [s for s in scheduler.running if s.num_scheduled]
        decode = [s.num_scheduled == 1 and s.num_uncomputed == 1 for s in scheduled]
        order = [s for s, d in zip(scheduled, decode) if d] + [s for s, d in zip(scheduled, decode) if not d]
        assert [id(s) for s in batch] == [id(s) for s in order]
        steady += bool(batch) and all(decode)
        return batch

    def checked_tables(kept: StepTables, tables: list[list[int]]) -> torch.Tensor:
        gathered = step_tables(kept, tables)
        assert gathered.tolist() == padded(tables, gathered.shape[1])
        return gathered

    def checked_growth(kept: StepTables, tables: list[list[int]], growth: list) -> torch.Tensor:
        gathered = grown(kept, tables, growth)
        assert gathered.tolist() == padded(tables, gathered.shape[1])
        return gathered

    def checked(table: SampleTable, rows: list[SampleRow]) -> tuple[np.ndarray, np.ndarray]:
        nonlocal draws
        at, counters = kept(table, rows)
        reference = SampleTable(max(len(rows), 1))
        fresh_at, fresh_counters = kept(reference, rows)
        for name in ("columns", "seeds", "greedy", "logprobs", "adjusts"):
            assert np.array_equal(getattr(table, name)[..., at], getattr(reference, name)[..., fresh_at]), name
        gathered, fresh = table.gathered(at), reference.gathered(fresh_at)
        for name in ("columns", "seeds", "greedy", "any_greedy", "wanted", "adjusts"):
            assert np.array_equal(getattr(gathered, name), getattr(fresh, name)), name
        assert counters.tolist() == fresh_counters.tolist()
        assert counters.tolist() == [r.num_output for r in rows]
        draws += 1
        seen.update(r.serial for r in rows)
        return at, counters

    monkeypatch.setattr(SampleTable, "draw", checked)
    monkeypatch.setattr(Scheduler, "schedule", checked_schedule)
    monkeypatch.setattr(StepTables, "tables", checked_tables)
    monkeypatch.setattr(StepTables, "grown", checked_growth)
    monkeypatch.setattr(InputBatch, "follow", checked_follow)
    monkeypatch.setattr(EngineLoop, "_plain_tokens", checked_plain_tokens)
    config = EngineConfig(
        dtype="float32",
        model=tiny_models("llama").path,
        max_batch_size=6,
        max_batched_tokens=48,
        kv_cache_tokens=256,
        block_size=16,
        overlap_scheduling=overlap,
        dp_backend="thread",
    )
    with Engine(config) as engine:

        def run(job: tuple[list[int], SamplingParams, bool]) -> None:
            prompt, params, cancel = job
            stream = engine.submit(prompt, params, text=False)  # ids only: most steps' tokens plain
            for _ in stream:
                if cancel:
                    stream.cancel()

        with ThreadPoolExecutor(12) as pool:
            list(pool.map(run, requests(seed=1 if overlap == "on" else 0, count=120)))
        (loop,) = engine.loops
        assert loop.scheduler.num_preemptions > 0
        assert len(seen) > 4 * loop.runner.sample_table.capacity
        assert draws > 300 and steady > 50 and followed > 20 and calendared > 20 and plain > 20
        assert_idle(engine)


def padded(tables: list[list[int]], width: int) -> list[list[int]]:
    return [t + [0] * (width - len(t)) for t in tables]


def test_step_tables_hold_the_lists_through_steady_steps_joins_leaves_and_moves():
    """A batch decoding step after step (every table grows by a block or two now and then, in place), with sequences
    that join, leave from anywhere, swap places, are reset or cut (a new list, as preemption and truncation
    give) or skip a step, its longest table growing to 60 blocks and back: every step's tensor is contiguous,
    its rows the lists zero-padded, no wider than two width steps past the longest."""
    rng = random.Random(0)
    kept = StepTables(4)  # fewer rows than the batch will have: it grows
    batch = [[rng.randrange(1000)] for _ in range(6)]
    steady = most = 0
    for step in range(3000):
        for table in batch:
            if rng.random() < 1 / 16 and len(table) < (60 if step < 1500 else 8):
                table.extend(rng.randrange(1000) for _ in range(rng.choice((1, 1, 1, 2))))
        roll = rng.random()
        if roll < 0.03 and len(batch) > 1:
            batch.pop(rng.randrange(len(batch)))
        elif roll < 0.06 and len(batch) < 40:
            batch.append([rng.randrange(1000) for _ in range(rng.randint(1, 9))])
        elif roll < 0.07:
            i, j = rng.randrange(len(batch)), rng.randrange(len(batch))
            batch[i], batch[j] = batch[j], batch[i]
        elif roll < 0.08:
            i = rng.randrange(len(batch))
            batch[i] = batch[i][: rng.randint(1, len(batch[i]))]
        elif step >= 1500 and roll < 0.2:
            i = rng.randrange(len(batch))
            batch[i] = batch[i][:8]
        else:
            steady += 1
        lists = [t for t in batch if rng.random() > 0.02]  # one that skips a step (a prefill chunk's)
        if not lists:
            continue
        got, most = kept.tables(lists), max(most, len(lists))
        assert got.is_contiguous()
        assert got.tolist() == padded(lists, got.shape[1])
        assert max(map(len, lists)) <= got.shape[1] < max(map(len, lists)) + 2 * StepTables.WIDTH_STEP
    assert steady > 2000 and kept.rows == most > 4
