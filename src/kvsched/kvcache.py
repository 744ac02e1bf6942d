"""Paged KV-cache accounting (vLLM's block manager semantics, counted in blocks)."""
from __future__ import annotations

import operator

from kvsched.errors import KvschedError


# KV capacity in tokens below this: every count of tokens or blocks the engine keeps (KV held,
# context sums, clocks) then fits the 64-bit integers its compiled build computes in.
TOKEN_LIMIT = 1 << 62


class PagedKV:
    """A pool of `capacity_blocks` blocks of `block_size` tokens.

    A request holding t tokens of KV occupies ceil(t / block_size) blocks; block_size 1 is the
    token-granular memory model of the papers. The server owns the counter; policies read it.
    """

    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        try:                            # integers (numpy's too) as Python ints: the rows and records hold ints
            capacity_tokens, block_size = operator.index(capacity_tokens), operator.index(block_size)
        except TypeError:
            raise KvschedError(f"KV capacity and block size must be integers, got {capacity_tokens!r} "
                               f"and {block_size!r}") from None
        if block_size < 1:
            raise KvschedError(f"--block-size must be >= 1, got {block_size}")
        if capacity_tokens >= TOKEN_LIMIT:
            raise KvschedError(f"--kv-capacity ({capacity_tokens} tokens) must be below 2**62 ({TOKEN_LIMIT}) "
                               "tokens: the simulator counts them in 64-bit integers")
        if capacity_tokens < block_size:
            raise KvschedError(f"--kv-capacity ({capacity_tokens} tokens) is smaller than one "
                               f"block ({block_size} tokens)")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.used = 0

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def free(self) -> int:
        return self.capacity_blocks - self.used

    def blocks(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)
