"""KV block ids, reference counts, the free list and the prefix cache. Owned by one engine loop's thread."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable

from ..gateway.kv_events import CLEARED, FORGOTTEN, KEYED, RawEvent
from .sequence import Sequence

# A full block's identity: the digest of the block before it (b"" for the first) and its own tokens. The tokens
# are compared exactly, and the digest stands for the whole prefix before them: a cryptographic one, as
# vLLM's after CVE-2025-25183. Python's hash() of ints is theirs modulo 2**61 - 1 and unsalted, so a client
# could craft a prompt whose first block chains like another user's and have its later blocks served there.
BlockKey = tuple[bytes, tuple[int, ...]]


def chain_digest(key: BlockKey) -> bytes:
    """The digest a block's successor keys itself by: of the parent's digest and this block's tokens."""
    parent, tokens = key
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Hands out fixed-size KV blocks; the scheduler sees only counts and lists of ids.

    A block may be shared (a running sequence, an idle session, the prefix cache): it returns to the free
    list when its last holder releases it. With prefix caching, a full block keeps its key while free, so a
    later prompt that starts with the same tokens takes it back instead of computing it again; free blocks
    are handed out least recently released first, and a cached one handed out forgets its key (eviction).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest release first
        self.keys: list[BlockKey | None] = [None] * num_blocks  # a cached full block's key
        self.cached: dict[BlockKey, int] = {}  # key -> block id
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, found
        # What the keys did since the loop last took them (gateway/kv_events.py), only with prefix caching on.
        self.events: list[RawEvent] | None = [] if prefix_caching else None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self.free)} free")
        ids = []
        for _ in range(num_blocks):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            ids.append(block)
        return ids

    def retain(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] == 0:
                del self.free[i]
            self.ref_counts[i] += 1

    def release(self, ids: list[int]) -> None:
        """Drop one reference to each block; the tail goes first, so a prefix outlives its continuations."""
        for i in reversed(ids):
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free[i] = None

    # prefix cache ------------------------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that would extend a sequence whose KV ends at a block boundary with its next
        tokens (never its last token, which must be computed for its logits). Only looks: `take_prefix` takes
        them, once the scheduler knows there is room for the chunk after them."""
        lookup = self.lookup(seq)
        found: list[int] = []
        parent = seq.block_hashes[lookup.start - 1] if lookup.start else b""
        for j in lookup:
            key = self._key(seq, j, parent)
            block = self.cached.get(key)
            if block is None:
                break
            found.append(block)
            parent = chain_digest(key)
        return found

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> int:
        """Extend the sequence with the blocks `match_prefix` found for it, and count the lookup in the hit
        rate. Returns the tokens taken from the cache."""
        self.queried_tokens += len(self.lookup(seq)) * self.block_size
        self.retain(blocks)
        seq.block_table.extend(blocks)
        for block in blocks:
            key = self.keys[block]
            assert key is not None  # match_prefix found it among the cached blocks, which all have keys
            seq.block_hashes.append(chain_digest(key))
        seq.num_computed += len(blocks) * self.block_size
        self.hit_tokens += len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def next_key(self, seq: Sequence, prefix: list[int]) -> tuple[int, BlockKey] | None:
        """The first block of `seq` that neither its keyed KV nor the cached `prefix` after it (`match_prefix`'s)
        holds, with its index and key: the block it keys next, once computed. None where its tokens fill no such
        block, or it keys none."""
        j = len(seq.block_hashes) + len(prefix)
        if not self.prefix_caching or not seq.keyable or j >= len(seq.token_ids) // self.block_size:
            return None
        if prefix:
            key = self.keys[prefix[-1]]
            assert key is not None, "a cached block"
            parent = chain_digest(key)
        else:
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
        return j, self._key(seq, j, parent)

    def num_free_of(self, blocks: Iterable[int]) -> int:
        """How many of these blocks are on the free list: taking a cached block that no one holds uses up a
        free block as allocating one does."""
        return sum(self.ref_counts[b] == 0 for b in blocks)

    def freed_by(self, tables: Iterable[list[int]]) -> set[int]:
        """The blocks that releasing each of these tables once would put on the free list."""
        drops = Counter(b for table in tables for b in table)
        return {b for b, n in drops.items() if self.ref_counts[b] == n}

    def cache_full_blocks(self, seqs: Iterable[Sequence]) -> None:
        """Give each sequence's newly full, computed blocks their keys, so later prompts can share them. A block
        whose last token is still on the device (overlap scheduling: computed, not yet read) waits for it. Over
        a step's hundreds of sequences, of which a few fill a block: the others cost a comparison each."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for seq in seqs:
            full = min(seq.num_computed, len(seq.token_ids)) // bs
            if full > len(seq.block_hashes) and seq.keyable:
                self._key_blocks(seq, full)

    def _key_blocks(self, seq: Sequence, full: int) -> None:
        for j in range(len(seq.block_hashes), full):
            key = self._key(seq, j, seq.block_hashes[j - 1] if j else b"")
            block = seq.block_table[j]
            digest = chain_digest(key)
            if key not in self.cached and self.keys[block] is None:
                self.cached[key] = block
                self.keys[block] = key
                if self.events is not None:
                    self.events.append((KEYED, digest, key, j))
            seq.block_hashes.append(digest)

    def make_private(self, block: int) -> bool:
        """Whether a block may be written over: one holder only. It leaves the prefix cache, as its tokens are
        about to change."""
        if self.ref_counts[block] != 1:
            return False
        self._forget(block)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every key (new weights make cached KV wrong; sleep frees it). Blocks in use stay in use."""
        self.cached.clear()
        self.keys = [None] * self.num_blocks
        if self.events is not None:
            self.events.append((CLEARED,))

    def take_events(self) -> list[RawEvent]:
        """What the keys did since the last call (the loop hands it over once a step)."""
        events = self.events or []
        if events:
            self.events = []
        return events

    def lookup(self, seq: Sequence) -> range:
        """The block indices of a sequence the prefix cache may supply: from the end of its KV, if that is at
        a block boundary and every block before it is keyed, up to the block that holds its last token. (A turn
        that ended with its step unread hands its session blocks not keyed yet: the next turn keys them.)"""
        start = len(seq.block_table)
        if (
            not self.prefix_caching
            or not seq.keyable
            or seq.prompt_logprobs is not None  # they need every prompt position's logits
            or seq.num_computed != start * self.block_size
            or len(seq.block_hashes) != start
        ):
            return range(0)
        return range(start, max(start, (len(seq.token_ids) - 1) // self.block_size))

    def _key(self, seq: Sequence, j: int, parent: bytes) -> BlockKey:
        """Block j's key, `parent` being the digest of block j - 1's key (b"" for the first block)."""
        return parent, tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])

    def _forget(self, block: int) -> None:
        key = self.keys[block]
        if key is not None:
            del self.cached[key]
            self.keys[block] = None
            if self.events is not None:
                self.events.append((FORGOTTEN, key))
