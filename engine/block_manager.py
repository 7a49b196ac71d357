"""KV block ids, reference counts and the free list. Owned by one engine loop's thread."""
from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out fixed-size KV blocks; the scheduler sees only counts and lists of ids.

    A block may be shared (a running sequence and an idle session, later the prefix cache): it returns to
    the free list when its last holder releases it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_ids):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(num_blocks)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def retain(self, ids: list[int]) -> None:
        for i in ids:
            self.ref_counts[i] += 1

    def release(self, ids: list[int]) -> None:
        for i in ids:
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)
