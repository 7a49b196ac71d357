"""The prefix cache's block events: the engine's log (engine/gateway/kv_events.py), SubscribeKvEvents and
FlushCache of the worker protocol over real gRPC (service/kv_events.py), and the real smg routing a long shared
prefix to the replica that caches it."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from lmgate.engine.config import EngineConfig
from lmgate.engine.gateway.kv_events import CLEARED, FORGOTTEN, KEYED, Cleared, KvEventLog, Removed, Stored
from lmgate.engine.scheduling.block_manager import chain_digest
from lmgate.service.kv_events import block_hash
from tests.serving import ServerThread, free_port
from tests.test_vllm_servicer import GUARD, MODEL, SMG, wait_until_served

BLOCK = 16  # EngineConfig's block size


# ------------------------------------------------------------------------------------------ the engine's log
def keyed(tokens: tuple[int, ...], parent: bytes = b"", position: int = 0) -> tuple:
    """A BlockManager's record of a block keyed: what a loop hands over."""
    key = (parent, tokens)
    return (KEYED, chain_digest(key), key, position)


def chain(*blocks: tuple[int, ...]) -> list[tuple]:
    events, parent = [], b""
    for position, tokens in enumerate(blocks):
        events.append(keyed(tokens, parent, position))
        parent = events[-1][1]
    return events


def test_log_chains_a_sequences_blocks_into_one_store_and_numbers_batches_without_gaps():
    log = KvEventLog()
    a, b = chain((1, 2), (3, 4))
    log.publish(0, [a, b])
    log.publish(0, [keyed((5, 6), b[1], 2)])
    first, second = log.read(0)
    assert second.seq == first.seq + 1 and second.first_event_id == first.first_event_id + 1
    assert first.events == [Stored(b"", [(a[1], (1, 2)), (b[1], (3, 4))])]
    assert second.events == [Stored(b[1], [(chain_digest((b[1], (5, 6))), (5, 6))])]
    assert log.read(second.seq) == [] and log.read(first.seq) == [second]


def test_log_speaks_for_the_server_a_block_stays_until_its_last_loop_forgets_it():
    log = KvEventLog()
    (a,) = chain((1, 2))
    (other,) = chain((7, 8))
    log.publish(0, [a, other])
    log.publish(1, [a])  # the second loop's copy: the server held it already
    log.publish(0, [(FORGOTTEN, a[2])])  # one copy is left
    assert len(log.read(0)) == 1
    log.publish(1, [(FORGOTTEN, a[2])])
    assert log.read(0)[-1].events == [Removed([a[1]])]
    log.publish(1, [(CLEARED,)])  # loop 1 held nothing more: nothing changes
    assert len(log.read(0)) == 2
    log.publish(0, [keyed((9, 9)), (CLEARED,)])  # nothing left anywhere: one event says so
    assert log.read(0)[-1].events == [Cleared()]


def test_log_history_is_a_ring_and_a_snapshot_has_the_live_blocks_parents_first():
    log = KvEventLog(max_blocks=3)
    blocks = chain((1,), (2,), (3,), (4,))
    log.publish(0, blocks[:2])
    log.publish(0, [(FORGOTTEN, blocks[0][2])])
    log.publish(0, list(reversed(blocks[2:])))  # a child keyed before its parent still comes after it
    first, last = log.span()
    assert log.read(0) is None and log.read(first - 2) is None  # the ring no longer reaches back
    assert [b.seq for b in log.read(first - 1)] == list(range(first, last + 1))
    assert log.read(last + 1) is None  # a cursor from another server
    seq, live = log.snapshot()
    assert seq == last and [tokens for _, _, tokens in live] == [(2,), (3,), (4,)]
    assert [parent for _, parent, _ in live] == [blocks[0][1], blocks[1][1], blocks[2][1]]


# ------------------------------------------------------------------------------------- over real gRPC
@pytest.fixture(scope="module")
def replica(checkpoint):
    """A server of its own with a KV cache of 32 blocks: its prefix cache evicts soon; these tests flush it and
    put it to sleep."""
    s = ServerThread(EngineConfig(dtype="float32", kv_cache_tokens=32 * BLOCK), checkpoint)
    yield s
    s.stop()


def stub(server) -> vllm_grpc.VllmEngineStub:
    return vllm_grpc.VllmEngineStub(server.channel())


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids no other test's prompt begins with (ordinary vocabulary, no special tokens)."""
    return random.Random(seed).choices(range(1000, 40000), k=num_tokens)


def generate(server, ids: list[int], max_tokens: int = 1) -> vllm.GenerateComplete:
    request = vllm.GenerateRequest(
        tokenized=vllm.TokenizedInput(input_ids=ids),
        sampling_params=vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    return list(stub(server).Generate(request, timeout=GUARD))[-1].complete


def blocks_of(ids: list[int]) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + BLOCK]) for i in range(0, len(ids) - BLOCK + 1, BLOCK)]


class Subscription:
    """SubscribeKvEvents read on a thread of its own, as the gateway reads it: `until` waits for what the test
    expects, with a guard against a hang."""

    def __init__(self, server, cursor: int = 0) -> None:
        request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=cursor)
        self.call = stub(server).SubscribeKvEvents(request, timeout=10 * GUARD)
        self.batches: list[common_pb2.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self._inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self._inbox.put(batch)
        except grpc.RpcError as exc:
            self._inbox.put(exc)

    def until(self, done) -> None:
        deadline = time.monotonic() + GUARD
        while not done(self):
            item = self._inbox.get(timeout=max(deadline - time.monotonic(), 0.001))
            if isinstance(item, grpc.RpcError):
                self.error = item
                return
            self.batches.append(item)

    def close(self) -> None:
        self.call.cancel()

    def events(self, kind: str) -> list:
        return [getattr(e, kind) for b in self.batches for e in b.events if e.HasField(kind)]

    def stored(self) -> dict[tuple[int, ...], tuple[int, int | None]]:
        """Token ids -> (block hash, parent hash) of every block stored so far (a later store wins)."""
        found = {}
        for event in self.events("stored"):
            parent = event.parent_block_hash if event.HasField("parent_block_hash") else None
            for block in event.blocks:
                assert block.block_size == BLOCK
                found[tuple(block.token_ids)] = (block.block_hash, parent)
                parent = block.block_hash
        return found

    def removed(self) -> set[int]:
        return {h for event in self.events("removed") for h in event.block_hashes}


def test_a_prompts_full_blocks_are_stored_with_their_tokens_and_chained(replica):
    ids = prompt(1, 3 * BLOCK + 2)
    sub = Subscription(replica)
    try:
        generate(replica, ids)
        wanted = blocks_of(ids)
        sub.until(lambda s: set(wanted) <= set(s.stored()))
    finally:
        sub.close()
    stored = sub.stored()
    hashes = [stored[b][0] for b in wanted]
    assert [stored[b][1] for b in wanted] == [None, *hashes[:-1]]  # each block's parent is the one before it
    key = (b"", wanted[0])  # the hash names the engine's own digest of the block and all before it
    assert hashes[0] == block_hash(chain_digest(key))
    seqs = [b.sequence_number for b in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_a_client_that_has_its_reply_finds_its_prompts_blocks_in_the_log(replica):
    """The loop hands a step's events over with its outputs, and the signal thread publishes them before it
    delivers those: by the time a reply has reached the client, a router reading the log sees its blocks."""
    for seed in range(30, 36):
        ids = prompt(seed, 2 * BLOCK + 3)
        generate(replica, ids)
        _, live = replica.engine.kv_events.snapshot()
        assert set(blocks_of(ids)) <= {tokens for _, _, tokens in live}, seed


def test_an_evicted_blocks_hash_is_removed(replica):
    first = prompt(2, 10 * BLOCK)
    sub = Subscription(replica)
    try:
        generate(replica, first)
        sub.until(lambda s: set(blocks_of(first)) <= set(s.stored()))
        hashes = {sub.stored()[b][0] for b in blocks_of(first)}
        for seed in range(3, 8):  # other prompts take the 32 free blocks, the oldest released first
            generate(replica, prompt(seed, 10 * BLOCK))
        sub.until(lambda s: hashes <= s.removed())
    finally:
        sub.close()
    assert sub.removed() <= {h for h, _ in sub.stored().values()}  # only what was stored is removed


def test_a_subscriber_behind_the_ring_gets_data_loss_then_a_snapshot_from_zero(replica):
    log = replica.engine.kv_events
    sub = Subscription(replica)
    try:
        ids = prompt(19, BLOCK + 1)
        generate(replica, ids)
        sub.until(lambda s: set(blocks_of(ids)) <= set(s.stored()))  # it reads the live stream now
        log.max_blocks = 4  # what a busy server's ring does to a slow reader, with one prompt of 6 blocks
        generate(replica, prompt(20, 6 * BLOCK + 1))
        sub.until(lambda s: s.error is not None)
    finally:
        log.max_blocks = 1 << 16
        sub.close()
    assert sub.error.code() == grpc.StatusCode.DATA_LOSS and "subscribe from 0" in sub.error.details()
    with pytest.raises(grpc.RpcError) as err:  # a cursor from before the history, or from another server
        next(iter(stub(replica).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=1))))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=log.span()[1] + 10)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub(replica).SubscribeKvEvents(request)))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "restarted" in err.value.details()
    resync = Subscription(replica)
    try:
        resync.until(lambda s: s.batches and s.batches[-1].snapshot.index == s.batches[-1].snapshot.count - 1)
        snapshot = resync.batches[0]
        assert snapshot.snapshot.count >= 1 and snapshot.events[0].HasField("cleared")
        live = {key[1] for key in replica.engine.loops[0].blocks.cached}  # the engine is idle: a stable read
        assert set(resync.stored()) == live and len(live) == snapshot.snapshot.blocks
        ids = prompt(21, 2 * BLOCK)
        generate(replica, ids)  # live events go on after the snapshot's last number
        resync.until(lambda s: set(blocks_of(ids)) <= set(s.stored()))
    finally:
        resync.close()
    seqs = [b.sequence_number for b in resync.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_flush_cache_clears_and_what_runs_keeps_its_blocks(replica):
    ids = prompt(30, 4 * BLOCK + 1)
    sub = Subscription(replica)
    try:
        generate(replica, ids)
        assert generate(replica, ids).cached_tokens == 4 * BLOCK
        running = stub(replica).Generate(
            vllm.GenerateRequest(
                tokenized=vllm.TokenizedInput(input_ids=prompt(31, 40)),
                stream=True,
                sampling_params=vllm.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            ),
            timeout=GUARD,
        )
        assert next(running).chunk.token_ids
        flushed = stub(replica).FlushCache(common_pb2.FlushCacheRequest(), timeout=GUARD)
        assert flushed.success
        sub.until(lambda s: s.events("cleared"))
        done = [m.complete for m in running if m.HasField("complete")]
        assert done[0].finish_reason == "length" and done[0].completion_tokens == 40
        assert generate(replica, ids).cached_tokens == 0  # forgotten
    finally:
        sub.close()
    info = replica.engine.info()
    assert info.kv_blocks_free == info.kv_blocks_total and info.running_sequences == 0


def test_sleep_clears(replica):
    ids = prompt(40, 2 * BLOCK + 1)
    generate(replica, ids)
    sub = Subscription(replica, replica.engine.kv_events.span()[1])
    try:
        replica.engine.sleep(1)
        sub.until(lambda s: s.events("cleared"))
    finally:
        replica.engine.wakeup()
        sub.close()


def test_rank_processes_events_reach_the_server_once_per_block(process_ranks_server):
    """Two ranks as processes: each step's events cross to the server; a prefix both ranks cache is stored once."""
    server = process_ranks_server
    ids = prompt(50, 3 * BLOCK + 1)
    sub = Subscription(server)
    try:
        generate(server, ids)
        sub.until(lambda s: set(blocks_of(ids)) <= set(s.stored()))
        before = len(sub.events("stored"))
        assert generate(server, ids).cached_tokens == 0  # round robin: the other rank computes it too
        assert stub(server).FlushCache(common_pb2.FlushCacheRequest(), timeout=GUARD).success
        sub.until(lambda s: s.events("cleared"))
    finally:
        sub.close()
    assert all(tuple(b.token_ids) not in blocks_of(ids) for e in sub.events("stored")[before:] for b in e.blocks)


# ------------------------------------------------------------------------------ behind the real gateway
def indexed_blocks(metrics_url: str, address: str) -> int:
    """Blocks the gateway has stored in its index for a worker, from its metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=GUARD).read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("smg_kv_event_blocks_total") and address in line and 'op="stored"' in line
    )


def complete_through(url: str, text: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    assert json.load(urllib.request.urlopen(request, timeout=GUARD))["choices"]


def words(seed: int, count: int) -> str:
    vocabulary = "river stone maple copper lantern orbit velvet harbor meadow signal thunder pepper".split()
    return " ".join(random.Random(seed).choices(vocabulary, k=count))


def test_the_gateway_routes_a_long_shared_prefix_to_the_replica_that_caches_it(replica, server):
    """Each prefix is cached on one replica behind the gateway's back (a request straight to it): only the KV
    events can tell the gateway where it is. Every later request that starts with it goes there, and finds it.
    The gateway's POST /flush_cache empties both caches."""
    if not os.path.exists(SMG):
        pytest.skip("the smg gateway is not installed (its wheel exists for Linux x86_64 only)")
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
         "--worker-urls", f"grpc://{replica.address}", f"grpc://{server.address}",
         "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",  # no cache miss or hit sent elsewhere
         "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"
    replicas, tokenizer = (replica, server), replica.engine.tokenizer
    try:
        wait_until_served(url, proc)
        holders = {seed: replicas[seed % 2] for seed in (60, 61, 62, 63)}
        prefixes = {seed: words(seed, 200) for seed in holders}  # some 12 blocks: most of each request
        for seed, holder in holders.items():
            ids = tokenizer.encode(prefixes[seed] + " Question zero?")
            before = indexed_blocks(metrics_url, holder.address)
            generate(holder, ids)
            deadline = time.monotonic() + GUARD
            while indexed_blocks(metrics_url, holder.address) < before + len(ids) // BLOCK:
                assert time.monotonic() < deadline, "the gateway never indexed the replica's blocks"
                time.sleep(0.05)
        for question in (" Question one?", " Question two?"):
            for seed, holder in holders.items():
                seen = [r.engine.info() for r in replicas]
                complete_through(url, prefixes[seed] + question)
                now = [r.engine.info() for r in replicas]
                served = [
                    r
                    for r, a, b in zip(replicas, seen, now)
                    if b.prefix_cache_queried_tokens > a.prefix_cache_queried_tokens
                ]
                assert served == [holder]
                hit = [b.prefix_cache_hit_tokens - a.prefix_cache_hit_tokens for a, b in zip(seen, now)]
                assert hit[replicas.index(holder)] >= 10 * BLOCK
        flush = urllib.request.Request(f"{url}/flush_cache", b"", method="POST")  # the gateway's FlushCache to all
        assert json.load(urllib.request.urlopen(flush, timeout=GUARD))["workers_flushed"] == 2
        assert not any(r.engine.loops[0].blocks.cached for r in replicas)
    finally:
        proc.terminate()
        proc.wait(GUARD)
