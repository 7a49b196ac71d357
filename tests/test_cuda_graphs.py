"""The CUDA-graph runner's buckets and padding (engine/step/cuda_graphs.py), on CPU tensors: which bucket a step
takes, what the padded rows hold, and which steps may run from a graph. The graphs themselves need CUDA
(tests/test_gpu.py); the engine through these buffers is in tests/test_triton_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch

from lmgate.engine.sampling.sampler import SampleRow, SampleTable, SamplingParams, launch_sample
from lmgate.engine.step.cuda_graphs import DecodeGraphs, buckets


@pytest.mark.parametrize(
    "max_batch,want",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        (100, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]),
        (256, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] + list(range(80, 257, 16))),
    ],
)
def test_buckets(max_batch, want):
    assert buckets(max_batch) == want


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    graphs = DecodeGraphs(100, 4, torch.device("cpu"), capture=False)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8, 9, 65, 97, 100)] == [1, 2, 4, 8, 8, 16, 80, 100, 100]


def test_only_decode_steps_that_fit_run_from_a_graph():
    graphs = DecodeGraphs(8, 4, torch.device("cpu"), capture=False)
    assert graphs.fits(num_rows=8, num_prefills=0, table_width=4)
    assert not graphs.fits(num_rows=9, num_prefills=0, table_width=4)  # more than the largest bucket
    assert not graphs.fits(num_rows=5, num_prefills=1, table_width=4)  # a mixed step
    assert not graphs.fits(num_rows=2, num_prefills=0, table_width=5)  # a table wider than the buffers


def test_pending_inputs_are_the_last_steps_draws():
    """Under overlap a decode's input is still on the device: by pairs (row, row of the draws), or every row's
    its own row's draw (a followed step); rows read by the host keep theirs, and padding stays token 0."""
    graphs = DecodeGraphs(8, 4, torch.device("cpu"), capture=False)
    drawn = torch.tensor([70, 71, 72])
    tables, lengths = [[1], [2], [3]], [4, 5, 6]
    ids, _, _ = graphs.load([5, 0, 0], [3, 4, 5], [3, 4, 5], tables, lengths, [(2, 0), (1, 2)], drawn)
    assert ids.tolist() == [5, 72, 70, 0]
    ids, _, _ = graphs.load([0, 0, 0], [4, 5, 6], [4, 5, 6], tables, [5, 6, 7], (), drawn, pending_in_order=True)
    assert ids.tolist() == [70, 71, 72, 0]
    ids, _, _ = graphs.load([1, 2, 3], [5, 6, 7], [5, 6, 7], tables, [6, 7, 8])  # read: nothing pending
    assert ids.tolist() == [1, 2, 3, 0]


def test_padded_rows_store_nothing_and_read_nothing():
    """A step of three in bucket four, after a step of five: the fourth row and every stale row are padding."""
    graphs = DecodeGraphs(8, 4, torch.device("cpu"), capture=False)
    graphs.load([9] * 5, [40] * 5, [100] * 5, [[1, 2, 3, 4]] * 5, [41] * 5)
    ids, positions, meta = graphs.load([7, 8, 9], [3, 17, 33], [3, 49, 65], [[5], [6, 2], [1, 4, 3]], [4, 18, 34])
    assert ids.tolist() == [7, 8, 9, 0] and positions.tolist() == [3, 17, 33, 0]
    assert meta.slot_mapping.tolist() == [3, 49, 65, -1]
    assert meta.num_decode == 4 and meta.triton and meta.prefills == []
    assert meta.decode.lengths.tolist() == [4, 18, 34, 0]
    assert meta.decode.block_tables.tolist() == [[5, 0, 0, 0], [6, 2, 0, 0], [1, 4, 3, 0], [0, 0, 0, 0]]
    assert graphs.slots[4:].tolist() == [-1] * 4 and graphs.lengths[4:].tolist() == [0] * 4


def test_table_rows_grow_in_place_and_a_new_list_gets_a_fresh_row():
    """A sequence's table list only grows until it is reset with a new list: the growing list keeps its row
    (only new entries are written), a new list starts from zeros, and a step sees exactly its tables."""
    graphs = DecodeGraphs(4, 6, torch.device("cpu"), capture=False)
    a, b = [3, 1], [7]
    _, _, meta = graphs.load([1, 2], [17, 0], [50, 112], [a, b], [18, 1])
    row_a = graphs.store.rows_for([a])[0]
    a.append(9)
    _, _, meta = graphs.load([1, 2], [32, 1], [144, 113], [a, b], [33, 2])
    assert graphs.store.rows_for([a])[0] == row_a
    assert meta.decode.block_tables.tolist() == [[3, 1, 9, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    a_reset = [4]  # the same sequence after preemption: a new list
    _, _, meta = graphs.load([5], [0], [64], [a_reset], [1])
    assert meta.decode.block_tables.tolist() == [[4, 0, 0, 0, 0, 0]]


def random_steps(seed: int, num_tables: int, width: int, steps: int):
    """Steps of 1..4 of `num_tables` block tables, each grown in place, reset (a new list) or truncated (a new,
    shorter list) before its step, never past `width` blocks: the lists of each step."""
    rng = random.Random(seed)
    tables = [[rng.randrange(100)] for _ in range(num_tables)]
    for _ in range(steps):
        step = rng.sample(range(num_tables), rng.randint(1, 4))
        for i in step:
            roll = rng.random()
            if roll < 0.1:
                tables[i] = [rng.randrange(100)]
            elif roll < 0.15 and len(tables[i]) > 1:
                tables[i] = tables[i][:-1]
            elif len(tables[i]) < width:
                tables[i].append(rng.randrange(100))
        yield [tables[i] for i in step]


def test_table_store_against_the_lists_over_many_steps():
    """Random steps of growing, reset and truncated tables, more sequences than the store has rows: every
    step's gathered tables equal its lists, zero-padded."""
    graphs = DecodeGraphs(4, 8, torch.device("cpu"), capture=False)
    for lists in random_steps(0, 20, 8, 300):
        n = len(lists)
        _, _, meta = graphs.load([0] * n, [0] * n, [0] * n, lists, [1] * n)
        got = meta.decode.block_tables.tolist()[:n]
        assert got == [t + [0] * (8 - len(t)) for t in lists]


def test_a_followed_step_writes_only_the_blocks_its_tables_gained():
    """Runs of followed steps (the same list of tables, a few grown by a block: `StepPlan.table_growth`)
    between steps of new lists, more tables than the store has rows: every step's gathered tables equal its
    lists, zero-padded, whichever way the store found them."""
    rng = random.Random(1)
    graphs = DecodeGraphs(6, 8, torch.device("cpu"), capture=False)
    for _ in range(40):
        lists = [[rng.randrange(1, 100)] for _ in range(rng.randint(1, 6))]
        growth = None  # the run's first step: found by the lists' ids
        for _ in range(rng.randint(1, 8)):
            n = len(lists)
            _, _, meta = graphs.load([0] * n, [0] * n, [0] * n, lists, [1] * n, growth=growth)
            assert meta.decode.block_tables.tolist()[:n] == [t + [0] * (8 - len(t)) for t in lists]
            growth = []
            for i, table in enumerate(lists):
                if len(table) < 8 and rng.random() < 0.4:
                    growth.append((i, len(table), rng.randrange(1, 100)))
                    table.append(growth[-1][2])
    stale = [[5, 6]]  # growth for another list than the last step's: found by ids, as any step
    _, _, meta = graphs.load([0], [0], [0], stale, [1], growth=[(0, 1, 6)])
    assert meta.decode.block_tables.tolist()[0] == [5, 6, 0, 0, 0, 0, 0, 0]


def test_a_step_that_passed_the_store_by_leaves_the_next_to_find_its_rows():
    """A followed run's step that ran eagerly (`TableStore.passed_by`): the blocks gained then are written at
    the next step through the store, though its growth names only that step's."""
    graphs = DecodeGraphs(4, 6, torch.device("cpu"), capture=False)
    lists = [[1], [2]]
    graphs.load([0, 0], [0, 0], [0, 0], lists, [1, 1])
    lists[0].append(3)  # gained at a step that did not come to the store
    graphs.store.passed_by()
    lists[1].append(4)
    _, _, meta = graphs.load([0, 0], [0, 0], [0, 0], lists, [1, 1], growth=[(1, 1, 4)])
    assert meta.decode.block_tables.tolist()[:2] == [[1, 3, 0, 0, 0, 0], [2, 4, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    "kinds,plain",
    [
        ([{"temperature": 0.7}, {"temperature": 1.3}, {"temperature": 0.2}], True),
        ([{"temperature": 0.7}, {"temperature": 0.0}, {"temperature": 0.2}], False),  # a greedy row
        ([{"temperature": 0.7}, {"temperature": 1.0, "top_k": 5}, {"temperature": 0.2}], False),
        ([{"temperature": 0.7}, {"temperature": 1.0, "min_p": 0.1}, {"temperature": 0.2}], False),
        ([{"temperature": 0.7}, {"temperature": 1.0, "logprobs": 2}, {"temperature": 0.2}], False),
        ([{"temperature": 0.7}, {"temperature": 1.0, "presence_penalty": 1.0}, {"temperature": 0.2}], False),
    ],
    ids=["temperatures", "greedy", "top-k", "min-p", "logprobs", "penalty"],
)
def test_rows_that_draw_at_a_temperature_alone_draw_through_the_graphs_buffers(kinds, plain):
    """A step of three in bucket four whose rows all draw at their temperature alone goes through
    `DecodeGraphs.draw` (run eagerly here: a CPU cannot capture), and over four steps draws the sampler's own
    tokens; any other row keeps the whole step on the sampler's path. The draw spans two blocks of the
    vocabulary, so both of its searches run; the padded row's logits are NaN and change nothing."""
    vocab, steps = 3000, 4
    torch.manual_seed(0)
    logits = [torch.randn(4, vocab) * 4 for _ in range(steps)]
    for step in logits:
        step[3] = float("nan")

    def tokens(through_graphs: bool) -> list[list[int]]:
        graphs = DecodeGraphs(8, 4, torch.device("cpu"), capture=False)
        table = SampleTable(4)
        rows = [SampleRow(SamplingParams(**kind), 11 + i, [1, 2, 3], 3) for i, kind in enumerate(kinds)]
        drawn, calls = [], []

        def draw(temperatures, uniforms):
            calls.append(len(uniforms))
            return graphs.draw(4, temperatures, uniforms)

        for step in logits:
            graphs._logits = step.clone()  # what the bucket's run leaves (`DecodeGraphs.run`)
            scratch = graphs._logits if through_graphs else step[:3].clone()
            plain_draw = draw if through_graphs else None
            out = launch_sample(scratch[:3], rows, table=table, scratch=True, plain=plain_draw).result()
            drawn.append(out.token_ids)
            for row, token in zip(rows, out.token_ids):
                row.token_ids.append(token)
        assert calls == ([3] * steps if through_graphs and plain else [])
        return drawn

    assert tokens(through_graphs=True) == tokens(through_graphs=False)
