"""Paged KV-cache bookkeeping: a pool of blocks with a free list, per-request block lists.

Block 0 is reserved (the contract's null block for graph padding) and never handed out.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(Exception):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(block_ids))

    def can_allocate(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_ids, num_tokens) <= self.num_free

    def allocate(self, block_ids: list[int], num_tokens: int) -> None:
        """Grow ``block_ids`` in place until it holds ``num_tokens`` tokens."""
        needed = self.blocks_needed(block_ids, num_tokens)
        if needed > self.num_free:
            raise OutOfBlocks(f"need {needed} blocks, {self.num_free} free")
        block_ids.extend(self.free_blocks.popleft() for _ in range(needed))

    def trim(self, block_ids: list[int], num_tokens: int) -> None:
        """Return the blocks past ``num_tokens`` (an optimistic allocation that proved too large)."""
        keep = -(-num_tokens // self.block_size)
        self.free_blocks.extend(block_ids[keep:])
        del block_ids[keep:]

    def free(self, block_ids: list[int]) -> None:
        self.free_blocks.extend(block_ids)
        block_ids.clear()

    def assert_all_free(self) -> None:
        leaked = self.num_blocks - 1 - self.num_free
        if leaked:
            raise AssertionError(f"{leaked} KV blocks still allocated while the engine is idle")
