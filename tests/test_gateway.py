"""The Gateway's data-parallel pop: engine loops agree through an AllReduce on a real ThreadComm.

The ranks here are plain threads playing engine loops, calling `Gateway.pop` as `EngineLoop.run` does.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from lmgate.engine.errors import ResourceExhausted, Unavailable
from lmgate.engine.gateway.gateway import Gateway
from lmgate.engine.comm import CommAborted, ThreadComm
from lmgate.engine.gateway.request import CancelFlag, Request, RequestKind
from lmgate.engine.gateway.request_queue import RequestQueue
from lmgate.engine.sampling.sampler import SamplingParams

LOOPS = 3


def generate_request(session_id: int = 0) -> Request:
    return Request(
        RequestKind.GENERATE,
        session_id,
        lambda _: None,
        input_ids=[1, 2, 3],
        params=SamplingParams(),
        stateless=not session_id,
    )


@pytest.fixture
def gateway():
    gw = Gateway(LOOPS)
    yield gw
    gw.shutdown()
    gw.stop_signals()


def pop_round(gateway: Gateway, comms: list[ThreadComm], has_work: list[bool]) -> list:
    """One step of every loop at once; each loop's result, by rank."""
    with ThreadPoolExecutor(len(comms)) as pool:
        futures = [pool.submit(gateway.pop, c.rank, 8, lambda r=c.rank: has_work[r], c) for c in comms]
        return [f.result(timeout=60) for f in futures]


def test_idle_loops_wait_together_and_all_step_when_one_gets_work(gateway):
    comms = ThreadComm.create_group(LOOPS)
    with ThreadPoolExecutor(LOOPS) as pool:
        futures = [pool.submit(gateway.pop, c.rank, 8, lambda: False, c) for c in comms]
        assert not wait(futures, timeout=0.2).done  # no work anywhere: every loop waits
        request = generate_request()
        gateway.push(request)
        results = [f.result(timeout=60) for f in futures]
    assert sorted(len(r) for r in results) == [0, 0, 1]  # one loop got it, the others step with nothing
    got = next(r for r in results if r)[0]
    assert got is request and got.unique_id > 0 and request.cancel_flag.value == CancelFlag.ACTIVE


def test_a_busy_loop_keeps_every_loop_stepping(gateway):
    comms = ThreadComm.create_group(LOOPS)
    for _ in range(20):
        assert pop_round(gateway, comms, [False, True, False]) == [[], [], []]


def test_requests_cancelled_while_queued_are_skipped(gateway):
    comms = ThreadComm.create_group(LOOPS)
    requests = [generate_request() for _ in range(LOOPS * 2)]
    for r in requests:
        gateway.push(r)
    for r in requests[::2]:
        assert gateway.cancel(r)
    popped = [r for rank in pop_round(gateway, comms, [False] * LOOPS) for r in rank]
    assert sorted(id(r) for r in popped) == sorted(id(r) for r in requests[1::2])
    assert len({r.unique_id for r in popped}) == len(popped)


def test_a_request_cancelled_while_queued_counts_its_wait_as_queue_time(gateway):
    """Its usage says how long it waited (the queue-time histogram once got a 0 for every such request)."""
    outputs = queue.Queue()
    request = Request(
        RequestKind.GENERATE,
        0,
        outputs.put,
        input_ids=[1, 2, 3],
        params=SamplingParams(),
        arrival=time.monotonic() - 5.0,
    )  # submitted 5 s ago
    gateway.push(request)
    assert gateway.cancel(request)
    usage = outputs.get(timeout=60).usage
    assert usage.prompt_tokens == 3 and usage.queue_seconds >= 5.0


def run_until_stopped(gateway: Gateway, comm: ThreadComm, has_work: bool) -> int:
    """An engine loop's pop cycle with an empty batch (max_infer 0); the number of steps it ran."""
    steps = 0
    while gateway.pop(comm.rank, 0, lambda: has_work, comm) is not None:
        steps += 1
    return steps


def test_shutdown_stops_every_loop_together_and_cancels_the_queue(gateway):
    comms = ThreadComm.create_group(LOOPS)
    ended = []
    queued = Request(RequestKind.GENERATE, 0, ended.append, input_ids=[1], params=SamplingParams())
    with ThreadPoolExecutor(LOOPS) as pool:
        # Two loops idle, one busy stepping: all must stop at the same round.
        loops = [pool.submit(run_until_stopped, gateway, c, c.rank == 2) for c in comms]
        gateway.push(queued)  # max_infer 0: it stays queued until shutdown hands it back
        gateway.shutdown()
        steps = [f.result(timeout=60) for f in loops]
    assert len(set(steps)) == 1 and steps[0] > 0
    with pytest.raises(Unavailable):
        gateway.push(generate_request())
    gateway.stop_signals()
    assert [o.finish_reason.name for o in ended] == ["CANCELLED"]


def test_an_aborted_peer_releases_the_others(gateway):
    comms = ThreadComm.create_group(LOOPS)
    with ThreadPoolExecutor(LOOPS) as pool:
        loops = [pool.submit(run_until_stopped, gateway, c, True) for c in comms[:2]]
        comms[2].abort()  # what a failing engine loop does before it leaves
        for f in loops:
            with pytest.raises(CommAborted):
                f.result(timeout=60)


def test_idle_loops_never_miss_an_arrival(gateway):
    """Requests arrive in pairs while every loop idles: each is taken exactly once and no loop is left waiting
    in a collective (a loop that read the arrival count just after a push must not wait for the next)."""
    comms = ThreadComm.create_group(LOOPS)
    taken: list[list[Request]] = [[] for _ in comms]

    def loop(comm: ThreadComm) -> None:
        while (got := gateway.pop(comm.rank, 8, lambda: False, comm)) is not None:
            taken[comm.rank] += got

    requests = [generate_request() for _ in range(600)]
    with ThreadPoolExecutor(LOOPS) as pool:
        loops = [pool.submit(loop, c) for c in comms]
        try:
            push_in_pairs(gateway, requests, taken)
        except AssertionError:
            comms[0].abort()  # release the stuck loops so that the failure is reported, not hung
            raise
        finally:
            gateway.shutdown()
        for f in loops:
            f.result(timeout=60)
    assert sorted(id(r) for t in taken for r in t) == sorted(id(r) for r in requests)


def push_in_pairs(gateway: Gateway, requests: list[Request], taken: list[list[Request]]) -> None:
    rng = random.Random(7)
    for n in range(0, len(requests), 2):
        # Two pushes a moment apart: the second lands while the loops wake up for the first.
        gateway.push(requests[n])
        spin_until = time.perf_counter() + rng.random() / 5000
        while time.perf_counter() < spin_until:
            pass
        gateway.push(requests[n + 1])
        guard = time.monotonic() + 30  # a hang guard, not a performance bound
        while sum(map(len, taken)) < n + 2:
            assert time.monotonic() < guard, f"request {n + 1} was never taken"
            time.sleep(0.0002)


def test_requests_cancelled_while_queued_give_their_places_back():
    """A cancelled stream has ended: its request no longer fills the queue, nor a place in the next batch."""
    gw = Gateway(1, max_queued=2)
    try:
        delivered = threading.Semaphore(0)
        dead = [generate_request() for _ in range(2)]
        for r in dead:
            r.on_output = lambda _: delivered.release()
            gw.push(r)
            gw.cancel(r)
        for _ in dead:  # their cancelled outputs handed over, as a client reading its stream would see
            assert delivered.acquire(timeout=60)
        live = [generate_request(), generate_request()]
        for r in live:
            gw.push(r)  # the queue holds 2: refused before the cancelled ones gave their places back
        with pytest.raises(ResourceExhausted):
            gw.push(generate_request())
        comm = ThreadComm.create_group(1)[0]
        assert gw.pop(0, 1, lambda: False, comm) == live[:1]
        assert gw.queues[0].num_generates == 1
    finally:
        gw.shutdown()
        gw.stop_signals()


class PausingQueue(RequestQueue):
    """A real queue whose pushes (of `kind`, or all) wait for `go` once `paused` is set: a caller preempted
    inside its enqueue."""

    def __init__(self, kind: RequestKind | None = None) -> None:
        super().__init__(8)
        self.kind = kind
        self.paused, self.entered, self.go = threading.Event(), threading.Event(), threading.Event()

    def push(self, request: Request) -> bool:
        if self.paused.is_set() and self.kind in (None, request.kind):
            self.entered.set()
            self.go.wait()
        return super().push(request)


def test_a_gate_closes_only_once_every_request_it_admitted_is_queued():
    """Sleep closes admission, then queues its control request: a Generate admitted before must be queued
    ahead of it (in a rank process, which sees no gate, a turn queued after the sleep would run with no KV
    cache), and one that comes after is refused."""
    queue = PausingQueue()
    gw = Gateway(queues=[queue])
    try:
        admitted = generate_request()
        queue.paused.set()
        with ThreadPoolExecutor(2) as pool:
            try:
                pushing = pool.submit(gw.push, admitted)
                assert queue.entered.wait(60)
                closing = pool.submit(gw.close_admission, "sleep", "asleep")
                assert not wait([closing], timeout=0.2).done  # still waits for the push it admitted
            finally:
                queue.paused.clear()
                queue.go.set()
            pushing.result(timeout=60)
            closing.result(timeout=60)
        gw.enqueue(0, Request(RequestKind.SLEEP, 0, lambda _: None))
        assert [r.kind for r in queue.pop(8)] == [RequestKind.GENERATE, RequestKind.SLEEP]
        with pytest.raises(Unavailable, match="asleep"):
            gw.push(generate_request())
        with pytest.raises(Unavailable, match="asleep"):
            gw.start_session(0)
    finally:
        gw.shutdown()
        gw.stop_signals()


def test_a_session_started_with_an_ended_sessions_id_follows_the_old_ones_kill():
    """End unbinds the id, cancels its running turn, then queues its KILL: a Start and turn of the same id in
    between must queue behind all that, or the loop would run the new turn on the old session's history (or
    beside its turn still running) and then kill it."""
    queue = PausingQueue(RequestKind.KILL)
    gw = Gateway(queues=[queue])
    try:
        gw.start_session(7)
        running = generate_request(7)
        gw.push(running)
        assert gw.pop(0, 8, lambda: False, ThreadComm.create_group(1)[0]) == [running]
        told = []
        running.on_cancel = lambda: told.append(queue.entered.is_set())  # a rank process is told by message
        queue.paused.set()

        def start_again() -> None:
            gw.start_session(7)
            gw.push(generate_request(7))

        with ThreadPoolExecutor(2) as pool:
            try:
                ending = pool.submit(gw.kill, 7, lambda _: None)
                assert queue.entered.wait(60)
                starting = pool.submit(start_again)
                wait([starting], timeout=0.5)
            finally:
                queue.go.set()
            ending.result(timeout=60)
            starting.result(timeout=60)
        assert [r.kind for r in queue.pop(8)] == [RequestKind.KILL, RequestKind.GENERATE]
        assert told == [False]  # the running turn's cancel went out before the KILL
    finally:
        gw.shutdown()
        gw.stop_signals()


def test_a_control_closed_in_its_queue_is_unavailable_not_done(gateway):
    """Sleep frees the weights once every loop has handled its SLEEP: a SLEEP that shutdown cancelled in the
    queue was handled by no loop, which may still be stepping on those weights."""
    with ThreadPoolExecutor(1) as pool:
        sleeping = pool.submit(gateway.control, RequestKind.SLEEP)
        while sum(queue.state()[0] for queue in gateway.queues) < LOOPS:
            time.sleep(0.01)
        gateway.shutdown()
        with pytest.raises(Unavailable, match="shutting down"):
            sleeping.result(timeout=60)
    with pytest.raises(Unavailable, match="shutting down"):
        gateway.control(RequestKind.WAKE_KV)


def test_outputs_handed_over_while_the_signal_thread_stops_keep_their_order():
    """A step's outputs notified after `stop_signals` began, while the signal thread still delivers an earlier
    step's, come after that step's: the thread drains what it is handed before callers deliver their own."""
    gw = Gateway(1)
    delivered: list[str] = []
    first_started, release = threading.Event(), threading.Event()

    def slow(output) -> None:
        first_started.set()
        release.wait(60)
        delivered.append("first")

    early = Request(RequestKind.GENERATE, 0, slow, input_ids=[1], params=SamplingParams())
    late = Request(
        RequestKind.GENERATE, 0, lambda _: delivered.append("second"), input_ids=[1], params=SamplingParams()
    )
    gw.notify([(early, 5, 0, "0")])
    assert first_started.wait(60)  # the signal thread is inside the first step's delivery
    stopper = threading.Thread(target=gw.stop_signals)
    stopper.start()
    for _ in range(60_000):  # until the stop has begun (a guard against a hang, not a time limit)
        if gw._stopping:
            break
        time.sleep(0.001)
    assert gw._stopping
    gw.notify([(late, 6, 1, "0")])  # the next step's, from a loop that has not stopped yet
    release.set()
    stopper.join(60)
    assert not stopper.is_alive()
    assert delivered == ["first", "second"]
    gw.notify([(late, 7, 2, "0")])  # once the thread is gone the caller delivers at once
    assert delivered == ["first", "second", "second"]
    gw.shutdown()
