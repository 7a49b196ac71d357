"""HostComm collectives on real ranks: ThreadComm on one thread per rank, GlooComm on one spawned process per
rank over 127.0.0.1. The same bodies run on both."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable

import pytest

from lmgate.engine.comm import CommAborted, HostComm, RedOp, ThreadComm, gloo_comm
from lmgate.engine.comm.gloo_comm import GlooComm, new_secret

SIZES = [1, 2, 4]
BACKENDS = ["thread", "gloo"]
# (backend, size): a group of one needs no processes, so gloo starts at two
GROUPS = [("thread", 1), ("thread", 2), ("thread", 4), ("gloo", 2), ("gloo", 4)]
JOIN_TIMEOUT = 60.0  # guard against a hang only; a healthy run takes milliseconds (seconds for processes)


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


def _rank_process(port: int, secret: bytes, rank: int, size: int, jobs, results) -> None:
    """A spawned rank: join the group, then run each job, fn(comm, *args), on a group split fresh from it,
    sending back ("ok", value) or ("error", traceback). After an error it exits: that closes its connections,
    so a peer waiting for it raises instead of waiting until the guard."""
    comm = GlooComm.connect("127.0.0.1", port, rank, size, secret)
    for fn, args in iter(jobs.get, None):
        try:
            results.put((rank, "ok", fn(comm.split(color=0, key=rank), *args)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, "error", traceback.format_exc()))
            results.close()
            results.join_thread()
            os._exit(1)


class Exited(int):
    """A rank's result where the rank's process ended without sending one: its exit code."""


class RankProcesses:
    """`size` spawned rank processes in one GlooComm group, kept for several jobs (a process costs seconds
    to start: it imports torch). Spawn, never fork: the test process has gRPC and OpenMP threads."""

    def __init__(self, size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.store = GlooComm.create_store()
        self.jobs = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        secret = new_secret()
        self.procs = [
            ctx.Process(
                target=_rank_process, args=(self.store.port, secret, r, size, self.jobs[r], self.results), daemon=True
            )  # never outlive the test process
            for r in range(size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple) -> list[object]:
        """fn(comm, *args) on every rank; results by rank, `Exited` for a rank that exited without one."""
        for q in self.jobs:
            q.put((fn, args))
        got: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + JOIN_TIMEOUT
        while len(got) < len(self.procs):
            try:
                rank, kind, value = self.results.get(timeout=0.1)
                got[rank] = kind, value
            except queue.Empty:
                if not self.alive:  # a rank has gone: the others finish their job, then stop
                    self.close()
                    while not self.results.empty():
                        rank, kind, value = self.results.get()
                        got[rank] = kind, value
                    break
                if time.monotonic() > deadline:
                    self.close(kill=True)
                    pytest.fail("ranks are still blocked in a collective")
        errors = [value for kind, value in got.values() if kind == "error"]
        if errors:
            self.close()
            pytest.fail(errors[0])
        return [got[r][1] if r in got else Exited(self.procs[r].exitcode) for r in range(len(self.procs))]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(0 if kill else JOIN_TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.fixture(scope="module")
def on_ranks():
    """on_ranks(backend, size, fn, *args): fn(comm, *args) on every rank of a new group; results by rank.
    fn must be a module-level function, as spawned processes import it by name. Rank processes are kept
    between calls while every call succeeds."""
    kept: dict[int, RankProcesses] = {}

    def run(backend: str, size: int, fn: Callable, *args: object) -> list[object]:
        if backend == "thread":
            return run_ranks(ThreadComm.create_group(size), lambda c: fn(c, *args))
        if size not in kept or not kept[size].alive:
            kept[size] = RankProcesses(size)
        return kept[size].run(fn, args)

    yield run
    for ranks in kept.values():
        ranks.close()


def wait_until_waiting(comm: ThreadComm, n: int) -> None:
    """Until n ranks are blocked in the group's barrier (so abort really has someone to unblock)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while comm._group.barrier.n_waiting < n:
        assert time.monotonic() < deadline, "ranks never reached the barrier"
        time.sleep(0.001)


def _broadcasts(c: HostComm) -> list[str]:
    return [c.broadcast(f"from {c.rank}", root) for root in range(c.size)]


@pytest.mark.parametrize(("backend", "size"), GROUPS)
def test_broadcast_from_each_root(on_ranks, backend: str, size: int) -> None:
    assert on_ranks(backend, size, _broadcasts) == [[f"from {root}" for root in range(size)]] * size


def _bad_root(c: HostComm) -> str:
    with pytest.raises(ValueError):
        c.broadcast(1, root=c.size)
    return "raised"


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_rejects_bad_root(on_ranks, backend: str) -> None:
    assert on_ranks(backend, 2, _bad_root) == ["raised"] * 2


def _gather_ranks(c: HostComm) -> tuple:
    return c.rank, c.size, c.all_gather((c.rank, "x" * 1000 * c.rank))  # different lengths on the wire


@pytest.mark.parametrize(("backend", "size"), GROUPS)
def test_all_gather_is_in_rank_order(on_ranks, backend: str, size: int) -> None:
    gathered = [(r, "x" * 1000 * r) for r in range(size)]
    assert on_ranks(backend, size, _gather_ranks) == [(r, size, gathered) for r in range(size)]


def _reductions(c: HostComm) -> list[object]:
    v = c.rank + 1
    return [
        c.all_reduce(v, RedOp.SUM),
        c.all_reduce(v, RedOp.MIN),
        c.all_reduce(v, RedOp.MAX),
        c.all_reduce([v, -v, 7], RedOp.SUM),
        c.all_reduce([v, -v, 7], RedOp.MIN),
        c.all_reduce([v, -v, 7], RedOp.MAX),
        c.all_reduce([2**40 + v], RedOp.SUM),  # int64 on the wire
    ]


@pytest.mark.parametrize(("backend", "size"), GROUPS)
def test_all_reduce_ints_and_lists(on_ranks, backend: str, size: int) -> None:
    total = size * (size + 1) // 2
    expected = [total, 1, size, [total, -total, 7 * size], [1, -size, 7], [size, -1, 7], [size * 2**40 + total]]
    assert on_ranks(backend, size, _reductions) == [expected] * size


def _uneven_lists(c: HostComm) -> str:
    with pytest.raises(ValueError):
        c.all_reduce([1] * (c.rank + 1), RedOp.SUM)
    return "raised"


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_lists_of_different_lengths_fail_on_every_rank(on_ranks, backend: str) -> None:
    assert on_ranks(backend, 2, _uneven_lists) == ["raised", "raised"]


def _late_last_rank(c: HostComm) -> float:
    """The time each rank leaves the barrier, which the last rank enters late."""
    if c.rank == c.size - 1:
        time.sleep(0.2)
    entered = time.monotonic()  # one clock for every process of this machine (CLOCK_MONOTONIC)
    c.sync()
    return entered if c.rank == c.size - 1 else time.monotonic()


@pytest.mark.parametrize(("backend", "size"), GROUPS)
def test_sync_waits_for_every_rank(on_ranks, backend: str, size: int) -> None:
    times = on_ranks(backend, size, _late_last_rank)
    assert all(left >= times[-1] for left in times[:-1])  # nobody left before the last rank arrived


def _mixed(c: HostComm, rounds: int) -> int:
    size, ranks = c.size, range(c.size)
    for i in range(rounds):
        root = i % size
        assert c.broadcast((i, c.rank), root) == (i, root)
        assert c.all_gather(i * 10 + c.rank) == [i * 10 + r for r in ranks]
        assert c.all_reduce(i + c.rank, RedOp.SUM) == sum(i + r for r in ranks)
        assert c.all_reduce([i - c.rank, i + c.rank], RedOp.MIN) == [i - (size - 1), i]
        assert c.all_reduce(i * c.rank, RedOp.MAX) == i * (size - 1)
        if i % 7 == 0:
            c.sync()
    return i


@pytest.mark.parametrize(("backend", "size"), GROUPS)
def test_back_to_back_mixed_collectives(on_ranks, backend: str, size: int) -> None:
    """Values change every call, so a value delivered to the wrong call shows up as a mismatch."""
    assert on_ranks(backend, size, _mixed, 200) == [199] * size


def _split_reversed(c: HostComm) -> tuple:
    sub = c.split(color=c.rank % 2, key=-c.rank)
    gathered = sub.all_gather(c.rank)
    total = sub.all_reduce(c.rank, RedOp.SUM)
    from_root = sub.broadcast(c.rank, root=0)
    sub.sync()
    again = c.split(color=0, key=c.rank)  # a second split names new keys; the parent still works
    c.sync()
    return sub.rank, sub.size, gathered, total, from_root, again.all_gather(c.rank)


@pytest.mark.parametrize(("backend", "size"), GROUPS)
def test_split_even_odd_with_reversed_keys(on_ranks, backend: str, size: int) -> None:
    results = on_ranks(backend, size, _split_reversed)
    for rank, (sub_rank, sub_size, gathered, total, from_root, everyone) in enumerate(results):
        members = sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)
        assert sub_size == len(members)
        assert sub_rank == members.index(rank)
        assert gathered == members
        assert total == sum(members)
        assert from_root == members[0]
        assert everyone == list(range(size))


def test_size_one_needs_no_threads() -> None:
    (comm,) = ThreadComm.create_group(1)
    assert comm.broadcast("v") == "v"
    assert comm.all_gather(3) == [3]
    assert comm.all_reduce([1, 2], RedOp.MAX) == [1, 2]
    comm.sync()
    sub = comm.split(color=5, key=0)
    assert (sub.rank, sub.size, sub.all_gather("s")) == (0, 1, ["s"])


def _lone_rank(c: HostComm) -> str:
    assert c.all_reduce([3, 4], RedOp.SUM) == [3, 4] and c.all_reduce(5, RedOp.MIN) == 5
    c.abort()
    with pytest.raises(CommAborted):
        c.all_reduce(1, RedOp.SUM)
    return "aborted"


def test_gloo_group_of_one_reduces_to_its_own_value_until_aborted(on_ranks) -> None:
    """A lone rank (one engine loop as a process) answers its every-step reduction itself."""
    assert on_ranks("gloo", 1, _lone_rank) == ["aborted"]


def test_thread_group_of_one_reduces_to_its_own_value_until_aborted() -> None:
    """A lone loop thread's every-step reduction waits on no barrier, and still refuses once aborted."""
    (comm,) = ThreadComm.create_group(1)
    assert _lone_rank(comm) == "aborted"


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


def _abort_pending(c: HostComm, released: str) -> str:
    """Rank 0 aborts while its own collective waits for rank 1, which holds the group, never joins the
    collective, and leaves once rank 0 has checked (the file `released` appears)."""
    if c.rank == 1:
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "idle"
    raised = []

    def collective() -> None:
        try:
            c.all_reduce(1, RedOp.SUM)
        except CommAborted as exc:
            raised.append(str(exc))

    waiting = threading.Thread(target=collective)
    waiting.start()
    time.sleep(0.2)  # most likely blocked by now; if not, it finds the communicator aborted: the same outcome
    c.abort()
    waiting.join(JOIN_TIMEOUT)
    with pytest.raises(CommAborted):  # and the communicator stays aborted
        c.sync()
    open(released, "w").close()
    return raised[0] if raised else "still blocked"


def test_gloo_abort_raises_in_this_ranks_pending_and_later_collectives(on_ranks, tmp_path) -> None:
    assert on_ranks("gloo", 2, _abort_pending, str(tmp_path / "released")) == ["host communicator aborted", "idle"]


def _peer_exits(c: HostComm) -> str:
    c.sync()
    if c.rank == c.size - 1:
        time.sleep(0.2)  # the others are most likely blocked in the collective by now
        os._exit(3)
    with pytest.raises(CommAborted):
        c.all_reduce(c.rank, RedOp.SUM)
    with pytest.raises(CommAborted):
        c.sync()
    return "aborted"


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_peer_that_exits_mid_collective_fails_the_others(on_ranks, size: int) -> None:
    assert on_ranks("gloo", size, _peer_exits) == ["aborted"] * (size - 1) + [Exited(3)]


def _split_then_abort(c: HostComm) -> str:
    sub = c.split(color=0, key=c.rank)
    sub.sync()
    c.abort()
    with pytest.raises(CommAborted):
        sub.all_gather(c.rank)
    with pytest.raises(CommAborted):
        c.split(color=0, key=0)
    return "aborted"


def test_gloo_abort_reaches_communicators_split_from_it(on_ranks) -> None:
    assert on_ranks("gloo", 2, _split_then_abort) == ["aborted", "aborted"]


def _abort_reaches_peers(c: HostComm) -> str:
    """Rank 0 aborts the parent while the others wait for it in a collective of a group split from it."""
    sub = c.split(color=0, key=c.rank)
    if c.rank == 0:
        time.sleep(0.3)  # the others are most likely waiting by now; if not, they find the abort at once
        c.abort()
        return "aborted"
    with pytest.raises(CommAborted, match="by a peer"):
        sub.all_reduce(1, RedOp.SUM)
    with pytest.raises(CommAborted):  # and it stays aborted
        sub.sync()
    return "raised"


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_abort_reaches_peers_waiting_in_a_collective(on_ranks, size: int) -> None:
    assert on_ranks("gloo", size, _abort_reaches_peers) == ["aborted"] + ["raised"] * (size - 1)


def _abort_then_close_reaches_peers(c: HostComm) -> str:
    """As above, but the peers look at the store only every 2 s, long after rank 0 has dropped its group and
    closed its connections: what its neighbours see first is a closed connection, and the abort is still the
    cause they report. (Ranks not connected to rank 0 wait for a neighbour to give up, or for their next look.)"""
    poll, gloo_comm.ABORT_POLL = gloo_comm.ABORT_POLL, 2.0  # the rank processes are kept: put it back
    try:
        return _abort_reaches_peers(c)
    finally:
        gloo_comm.ABORT_POLL = poll


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_abort_then_closed_connection_still_reports_the_abort(on_ranks, size: int) -> None:
    assert on_ranks("gloo", size, _abort_then_close_reaches_peers) == ["aborted"] + ["raised"] * (size - 1)


def _late_broadcast(c: GlooComm, patient: bool) -> str:
    """A broadcast whose root comes 3 s late, on a group whose limit on a collective is 1 s."""
    short = GlooComm(
        c._store,
        c.rank,
        c.size,
        c._secret,
        prefix=f"late/{patient}",
        timeout=datetime.timedelta(seconds=1),
        hostname=c.hostname,
    )
    if c.rank == 0:
        time.sleep(3)
    try:
        return short.broadcast("late" if c.rank == 0 else None, patient=patient)
    except CommAborted:
        return "gave up"


@pytest.mark.parametrize("patient", [True, False], ids=["patient", "impatient"])
def test_a_patient_broadcast_waits_for_its_root_past_the_limit(on_ranks, patient):
    """A tensor-parallel follower waits for its idle leader's next command inside a broadcast; under the
    group's limit (10 minutes) it died after 10 idle minutes. A patient broadcast lifts the limit."""
    results = on_ranks("gloo", 2, _late_broadcast, patient)
    if patient:
        assert results == ["late", "late"]
    else:
        assert results[1] == "gave up"


class _Marker:
    """Unpickling one records it in the process that unpickles (a stand-in for code a pickle could run)."""

    def __reduce__(self):
        return _record_unpickled, ()


_unpickled: list[bool] = []


def _record_unpickled() -> str:
    _unpickled.append(True)
    return "unpickled"


def _impostor_broadcast(c: GlooComm) -> tuple[str, bool]:
    """Rank 0 sends under a secret of its own, as a process that took a peer's place on the ports would."""
    impostor = GlooComm(
        c._store, c.rank, c.size, new_secret() if c.rank == 0 else c._secret, prefix="impostor", hostname=c.hostname
    )
    try:
        impostor.broadcast(_Marker() if c.rank == 0 else None)
        outcome = "passed"
    except CommAborted as exc:
        outcome = str(exc)
    return outcome, bool(_unpickled)


def test_gloo_never_unpickles_a_value_its_secret_did_not_sign(on_ranks):
    """The store and gloo's connections are TCP that any local user reaches; a value they send must not be
    unpickled (which runs code)."""
    assert on_ranks("gloo", 2, _impostor_broadcast) == [
        ("passed", False),
        ("a message not signed with this group's secret: is another process on its ports?", False),
    ]
