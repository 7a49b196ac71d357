"""The per-row state a loop keeps across steps instead of building it from its sequences each step: the
sampler's table (`SampleTable`), checked at every draw against a table built from that draw's rows alone, the
block tables (`TableStore`) against the lists, and the scheduler's batch (a steady decode step returns its
decodes as found) against the order rebuilt from the running sequences: through joins, leaves, cancels,
preemptions, forks and slots recycled."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.sampling.sampler import SampleRow, SampleTable, SamplingParams, launch_sample, sample
from lmgate.engine.scheduling.scheduler import Scheduler
from lmgate.engine.step.block_tables import TableStore
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
    """Rows of every kind of sampling drawn in random subsets over 2,000 calls (a row twice in one call now and
    then), each draw appended to its row as a loop does: one table kept throughout, with 4 slots to start,
    gives every call the tokens of a table built for that call; rows that stopped drawing give their slots
    back, and the table grows only as far as one call needs."""
    rng = random.Random(0)
    pool = [SampleRow(SamplingParams(**rng.choice(KINDS)), rng.randrange(2**64), [1, 2, 3], 3) for _ in range(40)]
    table = SampleTable(4)
    for call in range(2000):
        live = pool[call // 100 : call // 100 + 12]  # rows come and go
        distinct = rng.sample(live, rng.randint(1, 8))
        rows = distinct + distinct[:1] if rng.random() < 0.05 else distinct
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
    were scheduled, decodes first, each in running order."""
    kept = SampleTable.draw
    seen: set[int] = set()
    draws = 0
    schedule, gather = Scheduler.schedule, TableStore.gather
    steady = 0  # steps of decodes only

    def checked_schedule(scheduler: Scheduler) -> list:
        nonlocal steady
        batch = schedule(scheduler)
        scheduled = [s for s in scheduler.running if s.num_scheduled]
        decode = [s.num_scheduled == 1 and s.num_uncomputed == 1 for s in scheduled]
        order = [s for s, d in zip(scheduled, decode) if d] + [s for s, d in zip(scheduled, decode) if not d]
        assert [id(s) for s in batch] == [id(s) for s in order]
        steady += bool(batch) and all(decode)
        return batch

    def checked_gather(store: TableStore, tables: list[list[int]]) -> torch.Tensor:
        gathered = gather(store, tables)
        width = max(map(len, tables))
        assert gathered.tolist() == [t + [0] * (width - len(t)) for t in tables]
        return gathered

    def checked(table: SampleTable, rows: list[SampleRow]) -> tuple[np.ndarray, np.ndarray]:
        nonlocal draws
        at, counters = kept(table, rows)
        reference = SampleTable(max(len(rows), 1))
        fresh_at, fresh_counters = kept(reference, rows)
        for name in ("columns", "seeds", "greedy", "logprobs", "adjusts"):
            assert np.array_equal(getattr(table, name)[..., at], getattr(reference, name)[..., fresh_at]), name
        assert counters.tolist() == fresh_counters.tolist()
        assert counters.tolist() == [r.num_output for r in rows]
        draws += 1
        seen.update(r.serial for r in rows)
        return at, counters

    monkeypatch.setattr(SampleTable, "draw", checked)
    monkeypatch.setattr(Scheduler, "schedule", checked_schedule)
    monkeypatch.setattr(TableStore, "gather", checked_gather)
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
            stream = engine.submit(prompt, params)
            for _ in stream:
                if cancel:
                    stream.cancel()

        with ThreadPoolExecutor(12) as pool:
            list(pool.map(run, requests(seed=1 if overlap == "on" else 0, count=120)))
        (loop,) = engine.loops
        assert loop.scheduler.num_preemptions > 0
        assert len(seen) > 4 * loop.runner.sample_table.capacity
        assert draws > 300 and steady > 50
        assert_idle(engine)
