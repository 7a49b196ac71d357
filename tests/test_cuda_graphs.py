"""The CUDA-graph runner's buckets and padding (engine/cuda_graphs.py), on CPU tensors: which bucket a step
takes, what the padded rows hold, and which steps may run from a graph. The graphs themselves need CUDA
(tests/test_gpu.py); the engine through these buffers is in tests/test_triton_kernels.py."""
from __future__ import annotations

import pytest
import torch

from lmgate.engine.cuda_graphs import DecodeGraphs, buckets


@pytest.mark.parametrize("max_batch,want", [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (100, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]),
    (256, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] + list(range(80, 257, 16))),
])
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
