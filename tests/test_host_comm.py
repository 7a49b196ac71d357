"""ThreadComm collectives on real threads, one thread per rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from lmgate.engine.distributed import CommAborted, RedOp, ThreadComm

SIZES = [1, 2, 4]
JOIN_TIMEOUT = 60.0  # guard against a hang only; a healthy run takes milliseconds


def run_ranks(comms: list[ThreadComm], fn: Callable[[ThreadComm], object]) -> list[object]:
    """Run fn(comm) on one thread per rank; return results by rank, or raise the error of the rank that
    failed first. A failing rank aborts the group so that its peers do not wait for it until the guard."""
    results: list[object] = [None] * len(comms)
    errors: list[BaseException] = []

    def body(comm: ThreadComm) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test thread
            errors.append(e)  # before abort, so the peers' CommAborted comes after the cause
            comm.abort()

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    if any(t.is_alive() for t in threads):
        for c in comms:
            c.abort()
        pytest.fail("a rank is still blocked in a collective")
    if errors:
        raise errors[0]
    return results


def wait_until_waiting(comm: ThreadComm, n: int) -> None:
    """Until n ranks are blocked in the group's barrier (so abort really has someone to unblock)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while comm._group.barrier.n_waiting < n:
        assert time.monotonic() < deadline, "ranks never reached the barrier"
        time.sleep(0.001)


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_from_each_root(size: int) -> None:
    comms = ThreadComm.create_group(size)
    results = run_ranks(comms, lambda c: [c.broadcast(f"from {c.rank}", root) for root in range(size)])
    assert results == [[f"from {root}" for root in range(size)]] * size


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_rejects_bad_root(size: int) -> None:
    comm = ThreadComm.create_group(size)[0]
    with pytest.raises(ValueError):
        comm.broadcast(1, root=size)


@pytest.mark.parametrize("size", SIZES)
def test_all_gather_is_in_rank_order(size: int) -> None:
    comms = ThreadComm.create_group(size)
    assert [c.rank for c in comms] == list(range(size))
    assert all(c.size == size for c in comms)
    results = run_ranks(comms, lambda c: c.all_gather((c.rank, "x" * c.rank)))
    assert results == [[(r, "x" * r) for r in range(size)]] * size


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_ints_and_lists(size: int) -> None:
    comms = ThreadComm.create_group(size)

    def body(c: ThreadComm) -> list[object]:
        v = c.rank + 1
        return [
            c.all_reduce(v, RedOp.SUM),
            c.all_reduce(v, RedOp.MIN),
            c.all_reduce(v, RedOp.MAX),
            c.all_reduce([v, -v, 7], RedOp.SUM),
            c.all_reduce([v, -v, 7], RedOp.MIN),
            c.all_reduce([v, -v, 7], RedOp.MAX),
        ]

    total = size * (size + 1) // 2
    expected = [total, 1, size, [total, -total, 7 * size], [1, -size, 7], [size, -1, 7]]
    assert run_ranks(comms, body) == [expected] * size


def test_all_reduce_lists_of_different_lengths_fail_on_every_rank() -> None:
    comms = ThreadComm.create_group(2)

    def body(c: ThreadComm) -> str:
        with pytest.raises(ValueError):
            c.all_reduce([1] * (c.rank + 1), RedOp.SUM)
        return "raised"

    assert run_ranks(comms, body) == ["raised", "raised"]


@pytest.mark.parametrize("size", SIZES)
def test_sync_waits_for_every_rank(size: int) -> None:
    comms = ThreadComm.create_group(size)
    arrived = [False] * size

    def body(c: ThreadComm) -> bool:
        if c.rank == size - 1:
            time.sleep(0.05)  # the last rank is late; nobody may pass the barrier before it arrives
        arrived[c.rank] = True
        c.sync()
        return all(arrived)

    assert run_ranks(comms, body) == [True] * size


@pytest.mark.parametrize("size", SIZES)
def test_back_to_back_mixed_collectives(size: int) -> None:
    """Values change every call, so a slot overwritten before a slow rank read it shows up as a mismatch."""
    comms = ThreadComm.create_group(size)
    ranks = range(size)

    def body(c: ThreadComm) -> int:
        for i in range(200):
            root = i % size
            assert c.broadcast((i, c.rank), root) == (i, root)
            assert c.all_gather(i * 10 + c.rank) == [i * 10 + r for r in ranks]
            assert c.all_reduce(i + c.rank, RedOp.SUM) == sum(i + r for r in ranks)
            assert c.all_reduce([i - c.rank, i + c.rank], RedOp.MIN) == [i - (size - 1), i]
            assert c.all_reduce(i * c.rank, RedOp.MAX) == i * (size - 1)
            if i % 7 == 0:
                c.sync()
        return i

    assert run_ranks(comms, body) == [199] * size


@pytest.mark.parametrize("size", SIZES)
def test_split_even_odd_with_reversed_keys(size: int) -> None:
    comms = ThreadComm.create_group(size)

    def body(c: ThreadComm) -> tuple[int, int, list[int], int, int]:
        sub = c.split(color=c.rank % 2, key=-c.rank)
        gathered = sub.all_gather(c.rank)
        total = sub.all_reduce(c.rank, RedOp.SUM)
        from_root = sub.broadcast(c.rank, root=0)
        sub.sync()
        c.sync()  # the parent still works after the split
        return sub.rank, sub.size, gathered, total, from_root

    results = run_ranks(comms, body)
    for rank, (sub_rank, sub_size, gathered, total, from_root) in enumerate(results):
        members = sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)
        assert sub_size == len(members)
        assert sub_rank == members.index(rank)
        assert gathered == members
        assert total == sum(members)
        assert from_root == members[0]


def test_size_one_needs_no_threads() -> None:
    (comm,) = ThreadComm.create_group(1)
    assert comm.broadcast("v") == "v"
    assert comm.all_gather(3) == [3]
    assert comm.all_reduce([1, 2], RedOp.MAX) == [1, 2]
    comm.sync()
    sub = comm.split(color=5, key=0)
    assert (sub.rank, sub.size, sub.all_gather("s")) == (0, 1, ["s"])


def test_create_group_rejects_empty_group() -> None:
    with pytest.raises(ValueError):
        ThreadComm.create_group(0)


@pytest.mark.parametrize("collective", ["sync", "all_gather", "all_reduce", "broadcast"])
def test_abort_unblocks_ranks_waiting_in_a_collective(collective: str) -> None:
    comms = ThreadComm.create_group(3)
    calls = {
        "sync": lambda c: c.sync(),
        "all_gather": lambda c: c.all_gather(c.rank),
        "all_reduce": lambda c: c.all_reduce(c.rank, RedOp.SUM),
        "broadcast": lambda c: c.broadcast(c.rank, root=2),
    }

    def body(c: ThreadComm) -> str:
        if c.rank == 2:  # the rank shutting down never joins; it aborts once the others are blocked
            wait_until_waiting(c, 2)
            c.abort()
        with pytest.raises(CommAborted):
            calls[collective](c)
        with pytest.raises(CommAborted):  # and the communicator stays aborted
            c.sync()
        return "aborted"

    assert run_ranks(comms, body) == ["aborted"] * 3


def test_abort_reaches_communicators_split_from_it() -> None:
    comms = ThreadComm.create_group(4)
    subs = run_ranks(comms, lambda c: c.split(color=c.rank % 2, key=c.rank))  # {0, 2} and {1, 3}

    def body(c: ThreadComm) -> str:
        if c.rank in (0, 1):  # their partners 2 and 3 never join, so they block in the sub-communicators
            with pytest.raises(CommAborted):
                subs[c.rank].all_gather(c.rank)
            return "aborted"
        if c.rank == 3:  # shuts down: aborts the parent once both are blocked
            wait_until_waiting(subs[0], 1)
            wait_until_waiting(subs[1], 1)
            c.abort()
        return "idle"

    assert run_ranks(comms, body) == ["aborted", "aborted", "idle", "idle"]
    with pytest.raises(CommAborted):
        subs[2].sync()


def test_split_of_an_aborted_parent_is_aborted() -> None:
    (comm,) = ThreadComm.create_group(1)
    sub = comm.split(color=0, key=0)
    comm.abort()
    with pytest.raises(CommAborted):
        sub.sync()
    with pytest.raises(CommAborted):
        comm.split(color=0, key=0)
