"""Automatic prefix caching (runtime/decoding/prefix.py): the cache's blocks, keys, LRU bound and
counters on synthetic arrays; then, on tiny random float32 decoders of both cache layouts, a
prompt started from a cached prefix gets the logits of a whole prefill (within float32
rounding), and multi-turn conversations get the same greedy and seeded-sampled tokens with the
cache on and off, through the row batch (the server's) and ``Model.generate`` (the library's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfport.export import ExportOptions, export_model
from tfport.models import build_model
from tfport.presets import get_preset
from tfport.runtime import load_model
from tfport.runtime.decoding.prefix import PrefixCache

HEADS, DIM = 2, 3  # the synthetic blocks' [Hkv, block, D]
NAMES = ("past_key_values.0.key", "past_key_values.0.value")


def _kv(length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((HEADS, length, DIM)).astype(np.float32) for name in NAMES}


def _block_bytes(block: int) -> int:
    return len(NAMES) * HEADS * block * DIM * 4  # float32


# ------------------------------------------------------------------------------ the cache alone
def test_lookup_finds_the_longest_cached_block_prefix_shorter_than_the_tokens():
    cache = PrefixCache(1 << 20, block_size=4)
    tokens = list(range(10, 20))  # 10 tokens: blocks [0:4] and [4:8] are full
    kv = _kv(10)
    cache.insert(tokens, kv)
    assert len(cache) == 2 and cache.bytes == 2 * _block_bytes(4)
    for query, expected in [(tokens, 8), (tokens[:9], 8), (tokens[:8], 4),  # one token left to prefill
                            (tokens[:5], 4), (tokens[:4], 0), (tokens + [1, 2], 8),
                            (tokens[:5] + [99] + tokens[6:], 4),  # differs in the second block
                            ([99] + tokens[1:], 0)]:
        prefix = cache.lookup(query)
        assert prefix.length == expected, query
        row = {name: np.zeros((HEADS, 12, DIM), np.float32) for name in NAMES}  # a row's cache
        prefix.copy_into(row)  # block by block
        for name in NAMES:
            np.testing.assert_array_equal(row[name][:, :expected], kv[name][:, :expected])
            assert not row[name][:, expected:].any()
            if expected:
                np.testing.assert_array_equal(prefix.kv[name], kv[name][:, :expected])
            else:
                assert prefix.kv == {}
    assert cache.hit_tokens == 8 + 8 + 4 + 4 + 0 + 8 + 4 + 0
    assert cache.miss_tokens == sum(len(q) for q in [tokens, tokens[:9], tokens[:8], tokens[:5], tokens[:4],
                                                     tokens + [1, 2], tokens, tokens]) - cache.hit_tokens


def test_a_block_is_keyed_by_its_whole_prefix():
    """The same four tokens after a different first block are another block (a chained key)."""
    cache = PrefixCache(1 << 20, block_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], _kv(8))
    assert cache.lookup([9, 9, 9, 9, 5, 6, 7, 8, 0]).length == 0
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]).length == 8


def test_blocks_are_copies_neither_side_can_change():
    cache = PrefixCache(1 << 20, block_size=4)
    kv = _kv(4)
    expected = {name: value.copy() for name, value in kv.items()}
    cache.insert([1, 2, 3, 4], kv)
    for value in kv.values():
        value[...] = 0  # the caller reuses its buffer
    prefix = cache.lookup([1, 2, 3, 4, 5])
    for value in prefix.kv.values():
        value[...] = 7  # a row writes into what it got
    for name in NAMES:
        np.testing.assert_array_equal(cache.lookup([1, 2, 3, 4, 5]).kv[name], expected[name])


def test_least_recently_used_blocks_go_first_under_the_bound():
    """Room for 3 blocks: a 4th evicts the least recently used, a conversation's deepest block
    before its first (a lookup touches the first block last)."""
    block = _block_bytes(4)
    cache = PrefixCache(3 * block, block_size=4)
    a, b = list(range(100, 108)), list(range(200, 208))
    cache.insert(a + [0], _kv(9, 1))
    assert cache.lookup(a + [0]).length == 8  # touches a's blocks, the first one last
    cache.insert(b, _kv(8, 2))  # two more blocks: one of a's must go
    assert len(cache) == 3 and cache.bytes == 3 * block <= cache.max_bytes
    assert cache.evicted_tokens == 4
    assert cache.lookup(a + [0]).length == 4  # a's second block went, its first stayed
    assert cache.lookup(b + [0]).length == 8
    cache.insert(list(range(300, 304)), _kv(4, 3))  # a's first block is now the least recent
    assert cache.lookup(a + [0]).length == 0 and cache.evicted_tokens == 8
    assert cache.bytes == 3 * block


def test_room_is_made_before_a_block_is_copied():
    """A full cache taking another prompt holds at most its bound plus the block being copied
    at any time (tracemalloc sees numpy's buffers): it evicts before it copies."""
    import tracemalloc

    def kv_of(seed):  # blocks of 64 tokens x 2 heads x 256 dims, 256 KiB: far above the bookkeeping
        return {name: np.random.default_rng(seed).standard_normal((HEADS, 512, 256)).astype(np.float32)
                for name in NAMES}

    block = 64 * HEADS * 256 * 4 * len(NAMES)
    cache = PrefixCache(8 * block, block_size=64)
    kv = kv_of(2)
    tracemalloc.start()
    try:
        cache.insert(list(range(1000, 1512)), kv_of(1))  # full: 8 blocks
        tracemalloc.reset_peak()
        held, _ = tracemalloc.get_traced_memory()
        cache.insert(list(range(2000, 2512)), kv)  # 8 new blocks, all of the first prompt's go
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    peak -= held
    assert cache.bytes == 8 * block and cache.evicted_tokens == 512
    assert cache.lookup(list(range(2000, 2513))).length == 512
    assert peak < 2 * block, (peak, block)  # one block in flight, not the prompt's eight


def test_a_prompt_longer_than_the_cache_keeps_its_first_blocks():
    block = _block_bytes(4)
    cache = PrefixCache(3 * block, block_size=4)
    cache.insert(list(range(50, 54)), _kv(4, 1))
    tokens = list(range(100, 120))  # five blocks: the other prompt's goes, then its first three stay
    cache.insert(tokens, _kv(20, 2))
    assert cache.bytes == 3 * block and cache.lookup(tokens).length == 12
    assert cache.lookup(list(range(50, 55))).length == 0


def test_a_block_with_non_finite_values_is_not_kept():
    cache = PrefixCache(1 << 20, block_size=4)
    kv = _kv(12)
    kv[NAMES[1]][0, 5, 0] = np.nan  # in the second block
    cache.insert(list(range(12)), kv)
    assert len(cache) == 1 and cache.lookup(list(range(13))).length == 4


@pytest.mark.parametrize("kwargs, message", [({"max_bytes": 0}, "max_bytes=0"),
                                             ({"max_bytes": 10, "block_size": 0}, "block_size=0"),
                                             ({"max_bytes": True}, "max_bytes=True")])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefixCache(**kwargs)


def test_from_mb():
    assert PrefixCache.from_mb(0) is None
    assert PrefixCache.from_mb(3).max_bytes == 3 * 2**20
    with pytest.raises(ValueError, match="prefix_cache_mb=-1"):
        PrefixCache.from_mb(-1)


# ------------------------------------------------------------------------------ on real graphs
# (target, preset): both cache layouts; on concat, RoPE and learned absolute positions (both
# counted from the attention mask, so a prefix's rest must continue at its length).
TARGETS = [("portable", "tiny-decoder"), ("portable", "tiny-decoder-gpt2"), ("ort", "tiny-decoder")]
BLOCK = 4  # small blocks: many hits and block boundaries inside short prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    out = {}
    for target, preset in TARGETS:
        config = get_preset(preset).replace(tie_embeddings=False, d_model=64, max_positions=128)
        model = build_model(config, seed=5)
        with torch.no_grad():  # every parameter off its initial value, for varied continuations
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        export_model(model, root / f"{target}-{preset}", ExportOptions(target=target))
        out[target, preset] = load_model(root / f"{target}-{preset}", intra_op_threads=1)
    return out


def _conversation(vocab: int, seed: int, turns: int = 5) -> list[list[int]]:
    """Each turn's new (user) tokens; the prompt of turn k is the history so far plus them."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(2, 9))).tolist() for _ in range(turns)]


@pytest.mark.parametrize("key", TARGETS)
def test_a_prompt_started_from_a_cached_prefix_gets_the_logits_of_a_whole_prefill(models, key):
    model = models[key]
    runner = model.runners["decoder"]
    cache = PrefixCache(1 << 24, block_size=BLOCK)
    plain = model.decoding.rows(runner, 2, 128)
    prompt = np.random.default_rng(1).integers(4, model.config.vocab_size, size=23)
    warm = model.decoding.rows(runner, 1, 128, prefix=cache)
    warm.remove(warm.add(prompt[:13])[0])  # caches 3 blocks: [0:12]
    cached = model.decoding.rows(runner, 2, 128, prefix=cache)  # its cache holds nothing yet
    for length in (13, 16, 17, 23):
        row, logits = cached.add(prompt[:length])
        reference_row, reference = plain.add(prompt[:length])
        assert cache.lookup(prompt[:length]).length > 0
        # float32 rounding: the prefix's keys/values came from another call's kernels
        np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4)
        token = int(reference.argmax())
        for _ in range(3):  # decode steps on top of the filled cache
            step, reference_step = cached.step(np.array([token])), plain.step(np.array([token]))
            np.testing.assert_allclose(step[0], reference_step[0], rtol=1e-4, atol=1e-4)
            token = int(reference_step[0].argmax())
        cached.remove(row)
        plain.remove(reference_row)


def _run_rows(model, conversations: list[list[list[int]]], cache: PrefixCache | None,
              max_tokens: int = 6) -> list[list[int]]:
    """The conversations' turns through one row batch of 3 rows, each conversation's turns in
    order, several conversations live at once; greedy -> every turn's reply."""
    batch = model.decoding.rows(model.runners["decoder"], 3, 128, prefix=cache)
    history = [[] for _ in conversations]
    turn = [0] * len(conversations)
    replies: list[list[int]] = []
    live: dict[int, tuple] = {}  # conversation -> (row, reply)
    while len(replies) < sum(len(c) for c in conversations):
        for c, conversation in enumerate(conversations):
            if c not in live and turn[c] < len(conversation) and len(batch.rows) < batch.capacity:
                history[c] += conversation[turn[c]]
                row, logits = batch.add(np.array(history[c]))
                live[c] = (row, [int(logits.argmax())])
        order = sorted(live, key=lambda c: live[c][0].index)
        for c in [c for c in order if len(live[c][1]) == max_tokens]:
            row, reply = live.pop(c)
            batch.remove(row)
            replies.append(reply)
            history[c] += reply  # the next turn resends the reply
            turn[c] += 1
        order = [c for c in order if c in live]
        if order:
            logits = batch.step(np.array([live[c][1][-1] for c in order]))
            for b, c in enumerate(order):
                live[c][1].append(int(logits[b].argmax()))
    return replies


@pytest.mark.parametrize("key", TARGETS)
def test_conversations_through_the_row_batch_get_the_same_greedy_tokens(models, key):
    model = models[key]
    conversations = [_conversation(model.config.vocab_size, seed) for seed in range(4)]
    expected = _run_rows(model, conversations, None)
    cache = PrefixCache(1 << 24, block_size=BLOCK)
    assert _run_rows(model, conversations, cache) == expected
    assert len({tuple(r) for r in expected}) > len(expected) // 2  # varied replies: not vacuous
    assert cache.hit_tokens > cache.miss_tokens  # later turns start from the cache


@pytest.mark.parametrize("key", TARGETS)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 20}])
def test_generate_over_a_conversation_reuses_the_previous_turns(models, key, sampling):
    """The library: one prompt per call, the model's own cache; sampled with one seed per turn."""
    model = models[key]
    turns = _conversation(model.config.vocab_size, 7, turns=6)

    def converse(cache: PrefixCache | None) -> list[list[int]]:
        model.prefix_cache = cache
        history, replies = [], []
        for t, new in enumerate(turns):
            history += new
            reply = model.generate([history], max_new_tokens=7, stop_token_ids=(), seed=t, **sampling)[0].tolist()
            replies.append(reply)
            history += reply
        return replies

    saved = model.prefix_cache
    try:
        expected = converse(None)
        cache = PrefixCache(1 << 24, block_size=BLOCK)
        assert converse(cache) == expected
    finally:
        model.prefix_cache = saved
    assert cache.hit_tokens > cache.miss_tokens  # most of each later turn's history was reused


@pytest.mark.parametrize("cached", [False, True])
def test_inplace_rows_grow_their_slots_without_changing_tokens(models, cached, monkeypatch):
    """``InplaceRows`` starts with few KV slots per row and doubles them as rows grow (the CPU
    attention kernel works over the whole buffer): rows that cross the growth, decoding together,
    get the tokens of a batch allocated at its full length from the start."""
    from tfport.runtime.decoding import inplace

    model = models["ort", "tiny-decoder"]
    conversations = [_conversation(model.config.vocab_size, seed) for seed in range(4)]
    monkeypatch.setattr(inplace, "INITIAL_SLOTS", 128)  # the batches' max_length: never grows
    expected = _run_rows(model, conversations, PrefixCache(1 << 24, block_size=BLOCK) if cached else None)
    grown = []
    original = inplace.InplaceRows._reserve

    def reserve(self, length):
        before = self.slots
        original(self, length)
        if self.slots != before:
            grown.append((before, self.slots))

    monkeypatch.setattr(inplace, "INITIAL_SLOTS", 4)
    monkeypatch.setattr(inplace.InplaceRows, "_reserve", reserve)
    got = _run_rows(model, conversations, PrefixCache(1 << 24, block_size=BLOCK) if cached else None)
    assert got == expected
    assert grown and grown[0][0] == 4 and all(b >= min(2 * a, 128) for a, b in grown), grown
