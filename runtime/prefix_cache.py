"""The prefix cache: KV of prompt prefixes, which later requests starting with the same tokens copy instead of
computing again (a system prompt sent with every request; a conversation's earlier turns).

Content-addressed by blocks of `block_tokens` tokens: a block's key is its tokens and the block before it in
the same prefix, so a block stands for its whole prefix and two prompts share exactly the blocks of their
common prefix. Only KV that a plain causal prefill of those tokens at positions 0, 1, ... computes is kept
(what a strategy hands out as a `PrefixKV` step): reused KV then sits at the positions it was computed at, so
its rotary embedding is the one a fresh prefill would give it.

The KV lives on the runner, in regions of its own beside the requests' (`Runner.add_region`), block after
block, made as the cache fills, up to its budget; when it is full the least recently used block goes. Touching
a prefix's blocks deepest first keeps every block older than its parent, so the block evicted is always one no
other block extends: nothing is left unreachable. Loads and stores are copies between regions
(`Runner.copy_kv`), one per run of adjacent blocks and layer. Only the scheduler thread calls this.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.runners.base import Runner

BLOCK_TOKENS = 16  # docs/runtime.md, "Prefix cache": why 16
REGION_BLOCKS = 64  # blocks a cache region holds: the cache grows a region at a time
DEFAULT_MB = 256

Key = tuple[int, tuple[int, ...]]  # (the parent block's id, 0 for the first block; this block's tokens)


def check_prefix_cache_mb(mb: float) -> None:
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 <= mb < float("inf"):
        raise RefusionError(f"prefix_cache_mb={mb!r} (--prefix-cache-mb) must be a number of MiB >= 0 "
                            f"(0 turns the prefix cache off; default {DEFAULT_MB}).")


@dataclass(frozen=True)
class _Block:
    id: int
    key: Key
    region: int  # the runner's region that holds its KV
    slot: int  # its place in that region, in blocks


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # requests that asked for a prefix
    hit_tokens: int = 0  # prompt tokens copied from the cache instead of prefilled
    stored_blocks: int = 0  # blocks copied into the cache
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, runner: Runner, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if block_tokens <= 0:
            raise RefusionError(f"block_tokens={block_tokens!r} must be a positive number of tokens.")
        self.runner, self.block_tokens = runner, block_tokens
        self.block_bytes = block_tokens * runner.kv_bytes_per_token
        self.capacity = max(0, budget_bytes) // self.block_bytes  # blocks the budget holds
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[Key, _Block] = OrderedDict()  # least recently used first
        self._free: list[tuple[int, int]] = []  # (region, slot) not holding a block; the lowest slot last
        self._reserved = 0  # blocks the cache's regions hold, used or free
        self._ids = 0

    @property
    def blocks(self) -> int:
        """Blocks holding a prefix's KV now."""
        return len(self._blocks)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of KV the cache's regions hold on the runner (at most the budget)."""
        return self._reserved * self.block_bytes

    def check(self) -> None:
        """Every reserved block is either used or free, within the budget (an invariant, for the tests)."""
        assert len(self._blocks) + len(self._free) == self._reserved <= self.capacity, (
            len(self._blocks), len(self._free), self._reserved, self.capacity)

    def load(self, ids: list[int], region: int) -> int:
        """Copy the KV of the longest cached prefix of `ids` into `region` at [0, n), in whole blocks and at
        most len(ids) - 1 tokens (the last prompt token is always fed: a request's first forward reads its
        logits); returns n."""
        self.stats.lookups += 1
        chain = self._match(ids, (len(ids) - 1) // self.block_tokens)
        self._copy([(b.region, b.slot, i) for i, b in enumerate(chain)], region, into_cache=False)
        self._touch(chain)
        cached = len(chain) * self.block_tokens
        self.stats.hit_tokens += cached
        return cached

    def store(self, ids: tuple[int, ...], region: int) -> None:
        """Keep the KV of `ids`' whole blocks, which `region` holds at [0, len(ids)): the blocks not cached yet
        are copied in, the least recently used evicted to make room."""
        chain: list[_Block] = []
        fresh: list[tuple[int, int, int]] = []  # (cache region, slot, block index in ids) to copy in
        parent = 0
        for i in range(len(ids) // self.block_tokens):
            key = (parent, tuple(ids[i * self.block_tokens : (i + 1) * self.block_tokens]))
            block = self._blocks.get(key)
            if block is None:
                place = self._place(keep=len(chain))
                if place is None:  # the budget holds no more of this prefix
                    break
                self._ids += 1
                block = self._blocks[key] = _Block(self._ids, key, *place)
                fresh.append((*place, i))
                self.stats.stored_blocks += 1
            self._blocks.move_to_end(key)  # out of eviction's way while this prefix is stored
            chain.append(block)
            parent = block.id
        self._copy(fresh, region, into_cache=True)
        self._touch(chain)

    def _match(self, ids: list[int], most: int) -> list[_Block]:
        chain: list[_Block] = []
        parent = 0
        for i in range(most):
            block = self._blocks.get((parent, tuple(ids[i * self.block_tokens : (i + 1) * self.block_tokens])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        """Most recently used: the prefix's blocks, deepest first, so each stays older than its parent."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def _place(self, keep: int) -> tuple[int, int] | None:
        """A free (region, slot): a free one, a new region's while the budget allows, else the least recently
        used block's (evicted), unless every block is one of the `keep` newest (the prefix being stored,
        which must stay whole); None then."""
        if not self._free and self._reserved < self.capacity:
            blocks = min(REGION_BLOCKS, self.capacity - self._reserved)
            region = self.runner.add_region()
            self.runner.allocate_kv(blocks * self.block_tokens, region)
            self._free = [(region, slot) for slot in reversed(range(blocks))]
            self._reserved += blocks
        if self._free:
            return self._free.pop()
        if len(self._blocks) <= keep:
            return None
        _, evicted = self._blocks.popitem(last=False)
        self.stats.evicted_blocks += 1
        return evicted.region, evicted.slot

    def _copy(self, blocks: list[tuple[int, int, int]], region: int, into_cache: bool) -> None:
        """Copy (cache region, slot, block index) blocks between the cache and `region`, where block i is at
        token i * block_tokens; adjacent blocks go as one copy."""
        t, run = self.block_tokens, 0
        for n, (cache_region, slot, index) in enumerate(blocks):
            run += 1
            following = blocks[n + 1] if n + 1 < len(blocks) else None
            if following == (cache_region, slot + 1, index + 1):
                continue
            first_slot, first = slot - run + 1, index - run + 1
            if into_cache:
                self.runner.copy_kv(region, first * t, cache_region, first_slot * t, run * t)
            else:
                self.runner.copy_kv(cache_region, first_slot * t, region, first * t, run * t)
            run = 0
