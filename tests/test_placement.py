"""Which GPU each rank process takes: a machine's ranks spread over its GPUs, a tensor-parallel group never
doubled up on one (NCCL refuses that), refused before any rank starts. The mapping runs on any machine; the
refusals are the engine's own, from a real `Engine`."""

from __future__ import annotations

import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.machine.placement import check_placement, rank_device
from lmgate.engine.ranks.rank_process import RankSpec
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest


def spec(rank: int, size: int, tp: int, nnodes: int) -> RankSpec:
    config = EngineConfig(engine_loops=size // tp, tensor_parallel=tp, nnodes=nnodes, master_port=29500)
    return RankSpec(config, "", rank, size, tp, "", 0, b"", "", "", 1, 1, 0, node=rank // (size // nnodes))


@pytest.mark.parametrize("tp, dp, nnodes, gpus", [(2, 1, 1, 2), (2, 2, 1, 4), (2, 2, 1, 2), (4, 2, 2, 4), (2, 3, 1, 3)])
def test_a_tensor_parallel_group_has_a_gpu_per_rank(tp, dp, nnodes, gpus):
    size = tp * dp
    specs = [spec(rank, size, tp, nnodes) for rank in range(size)]
    devices = {s.rank: rank_device("cuda", s.local_rank, gpus) for s in specs}
    for group in range(dp):
        ranks = [s for s in specs if s.dp_rank == group]
        assert len({(s.node, devices[s.rank]) for s in ranks}) == tp  # no two of a group on one GPU of a node
    for node in range(nnodes):
        on_node = [devices[s.rank] for s in specs if s.node == node]
        assert set(on_node) == {torch.device("cuda", i) for i in range(min(gpus, len(on_node)))}


def test_a_device_as_given_where_there_is_no_choice():
    assert rank_device("cpu", 3, 0) == torch.device("cpu")
    assert rank_device("cuda", 3, 1) == torch.device("cuda")  # one GPU: every rank on it
    assert rank_device("cuda:1", 3, 4) == torch.device("cuda", 1)  # pinned by the operator
    check_placement("cuda:1", 1, 4, 4)  # data parallelism alone may share a GPU
    check_placement("cpu", 4, 4, 0)


def test_a_group_spread_over_machines_needs_only_its_share_of_each_machines_gpus():
    check_placement("cuda", 4, 2, 2)  # --tensor-parallel 4 --nnodes 2: two ranks of the group on each machine
    with pytest.raises(InvalidRequest, match="puts 4 ranks of a group on each machine"):
        check_placement("cuda", 4, 4, 2)


@pytest.mark.parametrize(
    "device, error",
    [("cuda", "each needing a GPU of its own; this machine has"), ("cuda:0", "puts every rank on one GPU")],
)
def test_a_tensor_parallel_group_without_its_gpus_is_refused_before_any_rank_starts(device, error):
    too_many = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(InvalidRequest, match=error):
        Engine(EngineConfig(device=device, tensor_parallel=too_many))
