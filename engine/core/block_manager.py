"""KV cache block allocation with prefix caching.

One owner for block state: which blocks are free, how many sequences use each
block, and which full blocks are known by the hash of their token prefix.
A block gets a hash only once every token in it is an accepted (computed) token,
so cached blocks never hold rejected draft tokens.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


def block_hash(parent: int, token_ids: np.ndarray) -> int:
    return hash((parent, token_ids.tobytes()))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.hash_of_block: dict[int, int] = {}
        self.block_of_hash: dict[int, int] = {}
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: np.ndarray, max_tokens: int) -> tuple[list[int], int]:
        """Cached blocks covering the longest block-aligned prefix of token_ids[:max_tokens] (takes a
        reference on each), and the hash of the last one."""
        blocks, parent, last = [], 0, 0
        for i in range(max_tokens // self.block_size):
            parent = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            b = self.block_of_hash.get(parent)
            if b is None:
                break
            blocks.append(b)
            last = parent
        self.num_cache_queries += max_tokens // self.block_size
        self.num_cache_hits += len(blocks)
        for b in blocks:
            self._ref(b)
        return blocks, last

    def _ref(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.free[b]
        self.ref_counts[b] += 1

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow block_table to hold num_tokens; False (and no change) if there are not enough free blocks."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            b, _ = self.free.popitem(last=False)  # least recently freed first: keeps cached prefixes longest
            old = self.hash_of_block.pop(b, None)
            if old is not None:
                del self.block_of_hash[old]
            self.ref_counts[b] = 1
            block_table.append(b)
        return True

    def free_blocks(self, block_table: list[int]) -> None:
        for b in reversed(block_table):  # tail blocks are evicted before the shared head
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
        block_table.clear()

    def register_full_blocks(
        self, token_ids: np.ndarray, block_table: list[int], num_hashed: int, parent: int, num_computed: int
    ) -> tuple[int, int]:
        """Hash the blocks that became full of computed tokens; returns (num_hashed, last hash)."""
        while (num_hashed + 1) * self.block_size <= num_computed:
            lo = num_hashed * self.block_size
            parent = block_hash(parent, token_ids[lo : lo + self.block_size])
            b = block_table[num_hashed]
            if parent not in self.block_of_hash and b not in self.hash_of_block:
                self.block_of_hash[parent] = b
                self.hash_of_block[b] = parent
            num_hashed += 1
        return num_hashed, parent
