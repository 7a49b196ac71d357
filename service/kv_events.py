"""SubscribeKvEvents: the engine's prefix-cache block events (`KvEventLog`, engine/gateway/kv_events.py) as the
worker protocol's stream of `KvEventBatch`, in the form the Shepherd Model Gateway's cache-aware policy indexes.

What the gateway reads (smg 1.13, model_gateway's kv_event_monitor): of each stored block its `block_hash`, an
identity that removals name and a later store names as its `parent_block_hash`, and its `token_ids`, whose
content it matches against a request's tokens cut into blocks of `block_size` (learned from the first stored
block); batches numbered without gaps, one numbering for the server as a whole (no `dp_rank`: the log has
merged its loops). On a gap it subscribes again from the last number it applied. OUT_OF_RANGE when it
subscribes (its cursor is older than the history, or past it: a restarted server) and DATA_LOSS on the stream
(it fell behind the ring) make it forget this worker's blocks and subscribe from 0: that gets the whole history
while the ring still holds its first batch, else a snapshot of the live blocks (`KvSnapshotChunk`) and then what follows.
Headers go out at once, before any batch: the gateway waits for them to count the stream as open.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2

from lmgate.engine.gateway.kv_events import KvBatch, KvEventLog, Removed, Stored

SNAPSHOT_CHUNK_BLOCKS = 4096  # blocks a snapshot's message names: about 300 kB, well under a client's 4 MiB


def block_hash(digest: bytes) -> int:
    """The engine's block digest as the protocol's int64 (its first 8 bytes, signed): the gateway takes it for
    an identity only."""
    return int.from_bytes(digest[:8], "big", signed=True)


def stored_event(
    event_id: int, parent: bytes, blocks: list[tuple[bytes, tuple[int, ...]]], block_size: int
) -> common_pb2.KvCacheEvent:
    stored = common_pb2.KvBlocksStored(
        blocks=[common_pb2.KvBlock(block_hash=block_hash(d), token_ids=t, block_size=block_size) for d, t in blocks]
    )
    if parent:
        stored.parent_block_hash = block_hash(parent)
    return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)


def kv_event_batch(batch: KvBatch, block_size: int) -> common_pb2.KvEventBatch:
    events = []
    for event_id, event in enumerate(batch.events, start=batch.first_event_id):
        if isinstance(event, Stored):
            events.append(stored_event(event_id, event.parent, event.blocks, block_size))
        elif isinstance(event, Removed):
            removed = common_pb2.KvBlocksRemoved(block_hashes=[block_hash(d) for d in event.digests])
            events.append(common_pb2.KvCacheEvent(event_id=event_id, removed=removed))
        else:
            events.append(common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared()))
    return common_pb2.KvEventBatch(sequence_number=batch.seq, timestamp=batch.timestamp, events=events)


def snapshot_batches(log: KvEventLog, block_size: int) -> tuple[int, list[common_pb2.KvEventBatch]]:
    """The live blocks as a snapshot's chunks, numbered up to the last batch they include (which a stream
    continues after): the first clears, then each stores its share, parents first. Synthesized: event id 0."""
    seq, live = log.snapshot()
    count = min(max(1, -(-len(live) // SNAPSHOT_CHUNK_BLOCKS)), seq)  # never numbered below 1
    per_chunk = -(-len(live) // count)
    chunks = []
    for index in range(count):
        part = live[index * per_chunk : (index + 1) * per_chunk]
        events = [common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())] if index == 0 else []
        events += [stored_event(0, parent, [(digest, tokens)], block_size) for digest, parent, tokens in part]
        chunks.append(
            common_pb2.KvEventBatch(
                sequence_number=seq - count + 1 + index,
                events=events,
                snapshot=common_pb2.KvSnapshotChunk(index=index, count=count, blocks=len(live)),
            )
        )
    return seq, chunks


async def kv_event_stream(
    log: KvEventLog, block_size: int, cursor: int, context: grpc.aio.ServicerContext
) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The batches after `cursor` (0: from the start, or a snapshot), then each as it is published, until the
    engine stops or the subscriber leaves."""
    loop = asyncio.get_running_loop()
    published = asyncio.Event()

    def wake() -> None:  # on the publishing thread: one wake-up until the stream has looked again
        if not published.is_set():
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is left to wake
                loop.call_soon_threadsafe(published.set)

    stop_listening = log.listen(wake)
    try:
        if log.read(cursor) is None:
            if cursor:
                first, last = log.span()
                why = (
                    f"cursor {cursor} is past the last batch {last}: the server restarted"
                    if cursor > last
                    else f"the history begins at batch {first}, after cursor {cursor}"
                )
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"{why}; subscribe from 0 for a snapshot")
                return  # (abort raises)
            cursor, chunks = snapshot_batches(log, block_size)
            await context.send_initial_metadata(())
            for chunk in chunks:
                yield chunk
        else:
            await context.send_initial_metadata(())
        while True:
            published.clear()
            batches = log.read(cursor)
            if batches is None:
                first, _ = log.span()
                await context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"this subscriber fell {first - cursor - 1} batches behind and the history no longer reaches "
                    "back; subscribe from 0",
                )
                return  # (abort raises)
            for batch in batches:
                yield kv_event_batch(batch, block_size)
                cursor = batch.seq
            if log.closed and not batches:
                return
            await published.wait()
    finally:
        stop_listening()
