"""Automatic prefix caching: the keys and values of token prefixes already computed, reused by
the next sequence that starts with them (a multi-turn chat resends its whole history each turn).

The cache holds blocks of ``block_size`` tokens. A block's key is a chained hash: the hash of
its parent block's key and its own token ids, so a key names the whole prefix up to the block's
end, and two sequences share a block only when they share every token before it. Each block
keeps one array per cache input (``past_key_values.*``) [Hkv, block_size, D] in the graph's KV
dtype; the arrays are never written after insertion (a row copies them into its own cache).

    cache = PrefixCache(max_bytes=256 * 2**20)
    prefix = cache.lookup(prompt)              # the longest cached block-aligned prefix < len(prompt)
    prefix.copy_into(row_cache)                # its first prefix.length slots; prefill prompt[prefix.length:]
    cache.insert(tokens, kv)                   # kv[name] [Hkv, >= len(tokens), D]: its full blocks

Bytes are accounted per block; past ``max_bytes`` the least recently used blocks are evicted.
A lookup touches the blocks it walks from the deepest to the first, so a prefix's first blocks
(shared by more sequences) are the most recent and the deepest go first. Positions need no care
here: a cached prefix always starts at position 0, so the rest of the prompt continues from
``prefix.length``, as it would after a whole prefill.

Chunked prefill (``cache_chunk``) uses the cache as its scratch: a long prompt's chunks are
computed between a server's decode steps and kept here, and its own prefill starts from them.

Counters, in tokens: ``hit_tokens`` (prompt tokens read from the cache, including those a
prompt's own earlier chunks put there), ``miss_tokens`` (prompt tokens looked up and
prefilled), ``evicted_tokens`` (tokens of evicted blocks); ``bytes`` in use. Thread-safe (a
server's scheduler and the library may share one).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tfport.config.checks import is_int

logger = logging.getLogger(__name__)

MiB = 2**20
DEFAULT_MB = 256  # ~5,600 tokens of SmolLM2-135M's float32 cache (46 KiB a token)
BLOCK_SIZE = 32


@dataclass(frozen=True)
class Prefix:
    """The cached start of a sequence: ``length`` tokens (a multiple of the block size, 0 on a
    miss) in ``blocks``, each name -> [Hkv, block_size, D] (the cache's own arrays, never
    written: read them, or copy them with ``kv`` / ``copy_into``)."""

    length: int
    blocks: tuple[dict[str, np.ndarray], ...] = ()

    @property
    def kv(self) -> dict[str, np.ndarray]:
        """name -> [Hkv, length, D], a new array (empty when ``length`` is 0)."""
        if not self.blocks:
            return {}
        return {name: np.concatenate([block[name] for block in self.blocks], axis=1) for name in self.blocks[0]}

    def copy_into(self, buffers: Mapping[str, np.ndarray]) -> None:
        """Write the prefix into the first ``length`` slots of one row's ``buffers`` (name ->
        [Hkv, slots, D]) block by block: no copy of the whole prefix in between."""
        start = 0
        for block in self.blocks:
            for name, value in block.items():
                buffers[name][:, start:start + value.shape[1]] = value
            start += next(iter(block.values())).shape[1]


NO_PREFIX = Prefix(0)


class PrefixCache:
    """Blocks of keys and values keyed by a chained hash of their token prefix (module docstring)."""

    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE):
        if not is_int(max_bytes) or max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r}: expected a positive integer")
        if not is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size={block_size!r}: expected a positive integer")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._blocks: collections.OrderedDict[bytes, dict[str, np.ndarray]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_tokens = 0

    @classmethod
    def from_mb(cls, megabytes: int, block_size: int = BLOCK_SIZE) -> "PrefixCache | None":
        """A cache of ``megabytes`` MiB; None for 0 (no caching)."""
        if not is_int(megabytes) or megabytes < 0:
            raise ValueError(f"prefix_cache_mb={megabytes!r}: expected an integer >= 0 (0: off)")
        return cls(megabytes * MiB, block_size) if megabytes else None

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The chained keys of the first ``blocks`` full blocks of ``tokens``."""
        ids = np.asarray(tokens, dtype=np.int64)
        keys, parent = [], b""
        for b in range(blocks):
            parent = hashlib.blake2b(parent + ids[b * self.block_size:(b + 1) * self.block_size].tobytes(),
                                     digest_size=16).digest()
            keys.append(parent)
        return keys

    def _found(self, keys: list[bytes]) -> list[dict[str, np.ndarray]]:
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many tokens ``lookup(tokens)`` would find (nothing copied, touched or counted)."""
        keys = self._keys(tokens, (len(tokens) - 1) // self.block_size)
        with self._lock:
            return len(self._found(keys)) * self.block_size

    def lookup(self, tokens: Sequence[int], count: bool = True) -> Prefix:
        """The longest cached block-aligned prefix of ``tokens`` strictly shorter than it (one
        token at least is left to prefill, whose logits the caller needs). ``count``: add it to
        the hit and miss counters (a request's lookup; not a chunk of its prefill)."""
        keys = self._keys(tokens, (len(tokens) - 1) // self.block_size)
        with self._lock:
            found = self._found(keys)
            self._touch(keys[:len(found)])
            length = len(found) * self.block_size
            if count:
                self.hit_tokens += length
                self.miss_tokens += len(tokens) - length
        return Prefix(length, tuple(found)) if found else NO_PREFIX

    def insert(self, tokens: Sequence[int], kv: Mapping[str, np.ndarray]) -> None:
        """Keep the full blocks of ``tokens`` whose keys and values ``kv`` holds: name ->
        [Hkv, >= len(tokens), D], position i the keys/values of ``tokens[i]`` (read, not kept:
        new blocks are copied). Blocks already cached are touched; a block with non-finite
        values is not kept (nor the blocks after it). Room is made before each block is copied,
        by evicting other prompts' blocks, so the cache never holds more than ``max_bytes`` plus
        the block being checked; where that would evict this prompt's own, its deeper blocks are
        not kept."""
        keys = self._keys(tokens, len(tokens) // self.block_size)
        own = set(keys)
        with self._lock:
            self._touch(keys)  # its cached blocks newest: room is made from other prompts'
            for b, key in enumerate(keys):
                if key in self._blocks:
                    continue
                span = slice(b * self.block_size, (b + 1) * self.block_size)
                size = sum(value[:, span].nbytes for value in kv.values())
                if size > self.max_bytes or not self._make_room(size, own):
                    break
                block = {name: np.array(value[:, span]) for name, value in kv.items()}  # copies
                if not all(np.isfinite(v).all() for v in block.values()):
                    break
                self._blocks[key] = block
                self.bytes += size
            self._touch(keys)

    def _touch(self, keys: list[bytes]) -> None:
        """The cached ones of a prompt's ``keys`` made the newest, deepest first: the first
        blocks stay newest, so eviction takes a prompt's deeper blocks before its first."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _make_room(self, size: int, keep: set[bytes]) -> bool:
        """Evict the oldest blocks until ``size`` more bytes fit in ``max_bytes`` -> whether they
        do without evicting a block of ``keep`` (the prompt being inserted)."""
        while self.bytes + size > self.max_bytes:
            if not self._blocks or next(iter(self._blocks)) in keep:
                return False
            _, block = self._blocks.popitem(last=False)
            self.bytes -= sum(value.nbytes for value in block.values())
            self.evicted_tokens += self.block_size
        return True


def cached_start(cache: PrefixCache | None, tokens: Sequence[int]) -> Prefix:
    """``cache.lookup(tokens)``, or ``NO_PREFIX`` without a cache."""
    return NO_PREFIX if cache is None else cache.lookup(tokens)


def cache_chunk(cache: PrefixCache, prompt: np.ndarray, budget: int,
                prefill: Callable[[Prefix, int], Mapping[str, np.ndarray]]) -> int:
    """Chunked prefill through the cache: compute the keys and values of up to ``budget`` more
    tokens of ``prompt`` int64 [S] after its longest cached prefix, ending on a block boundary
    before its last token, and keep them -> the prompt's tokens now cached.

    ``prefill(start, stop)`` runs the tokens ``prompt[start.length:stop]`` on top of ``start``
    and returns their row's keys and values, name -> [Hkv, >= stop, D]. A later ``lookup``
    finds the chunks; the last one's prefill (the request's own) gives the logits."""
    start = cache.lookup(prompt, count=False)
    stop = min(start.length + budget, prompt.size - 1)
    stop -= stop % cache.block_size
    if stop > start.length:
        cache.insert(prompt[:stop], prefill(start, stop))
    return cache.cached_length(prompt)
