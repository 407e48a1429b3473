"""The GGUF files people download (issue 26): RoPE scaling from the metadata and tensors
(llama3's rope_freqs, LongRoPE's rope_factors_long/short, YaRN, linear), per-layer window
patterns, Mistral windows, Phi-4-mini's window of 0, and the architectures gpt2, bloom, mpt and
falcon (7B and the new decoder architecture, one or two norms).

Each file is written from a tiny transformers model the way llama.cpp's converter writes it
(``from_hf``) and compared with that source model, not with transformers' own GGUF loader (which
drops several of these settings): logits on a left- and a right-padded batch and greedy tokens,
with prompts past the sliding window and past the trained context of the scaled RoPEs (and, for
LongRoPE, a prompt within it too: its factors switch with the call's length).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tfport.models.generate import generate
from tfport.models.gguf import load_gguf
from tfport.models.gguf.loader import llama3_parameters
from tfport.models.positions import positions_from_mask

from ..hf.cases import SMALL, WINDOW, HFCase, assert_close, batch
from .from_hf import GGUFCase, llama3_rope_freqs, write_from_hf, written_once

_SIZE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # head dim 16
# llama3 over a 64-token trained context with base 100: the 8 frequencies of a 16-wide head fall
# in all three bands (1 kept, 4 interpolated, 3 divided by the factor); high_freq_factor 8, not
# Llama 3's 4, so the import has to recover it from rope_freqs.
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
           "original_max_position_embeddings": 64, "rope_theta": 100.0}
# Phi-3.5-style LongRoPE trained on 8 positions (tests.hf.cases' factors).
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
             "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0, 16.0]}

CASES = {case.name: case for case in [
    GGUFCase("llama3-rope-freqs", "llama", HFCase("llama3", "LlamaForCausalLM", "LlamaConfig", dict(
        _SIZE, rope_parameters=_LLAMA3), seed=60)),
    GGUFCase("llama-linear", "llama", HFCase("llama", "LlamaForCausalLM", "LlamaConfig", dict(
        _SIZE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), seed=61)),
    # Qwen2.5-style YaRN: factor 4 over a 16-token trained context, beta_fast given.
    GGUFCase("qwen2-yarn", "qwen2", HFCase("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(
        _SIZE, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                "beta_fast": 16.0, "rope_theta": 10000.0}), seed=62), weight_type="F16"),
    GGUFCase("phi3-longrope", "phi3", HFCase("phi3", "Phi3ForCausalLM", "Phi3Config", dict(
        _SIZE, sliding_window=None, original_max_position_embeddings=8, rope_parameters=_LONGROPE), seed=63)),
    # Mistral (written as llama, as the converter does) with a window on every layer.
    GGUFCase("mistral-window", "llama", HFCase("mistral", "MistralForCausalLM", "MistralConfig", dict(
        _SIZE, sliding_window=WINDOW), seed=64), weight_type="F16"),
    # Gemma 2 with a pattern of its own in the metadata: only the middle layer slides.
    GGUFCase("gemma2-pattern", "gemma2", HFCase("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(
        _SIZE, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        attn_logit_softcapping=20.0, final_logit_softcapping=10.0), seed=65),
        metadata={"attention.sliding_window_pattern": [False, True, False],
                  "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0}),
    # Gemma 3 (1 global layer in 6 by default) with a period of 2 in the metadata.
    GGUFCase("gemma3-period", "gemma3", HFCase("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        _SIZE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), seed=72),
        metadata={"attention.sliding_window_pattern": 2}),
    GGUFCase("gpt2", "gpt2", HFCase("gpt2", "GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64), seed=66), weight_type="F16"),
    # 6 heads: the per-head QKV regrouping is not a no-op by accident of symmetry.
    GGUFCase("bloom", "bloom", HFCase("bloom", "BloomForCausalLM", "BloomConfig", dict(
        hidden_size=48, n_layer=2, n_head=6), hf_position_ids=False, seed=67)),
    GGUFCase("mpt", "mpt", HFCase("mpt", "MptForCausalLM", "MptConfig", dict(
        d_model=32, n_layers=2, n_heads=4, max_seq_len=64), hf_position_ids=False, seed=68)),
    GGUFCase("falcon-7b", "falcon", HFCase("falcon", "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        parallel_attn=True, max_position_embeddings=64), seed=69),
        metadata={"attention.head_count_kv": 1}),
    GGUFCase("falcon-40b", "falcon", HFCase("falcon", "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, max_position_embeddings=64), seed=70), weight_type="F16",
        metadata={"attention.head_count_kv": 2}),
    GGUFCase("falcon2-one-norm", "falcon", HFCase("falcon", "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, num_ln_in_parallel_attn=1, max_position_embeddings=64), seed=71),
        metadata={"attention.head_count_kv": 2}),
]}
# Prompt lengths: past the window (4) and the trained contexts of YaRN (16) and LongRoPE (8);
# LongRoPE also within its trained context (the short factors: logits only, as greedy tokens
# would cross the switch, where transformers' Phi-3 generate recomputes the whole cache with the
# long factors and tfport keeps the cached keys: docs/architectures.md, "Longrope").
LENGTHS = {"phi3-longrope": (6, 12)}
PROMPT = 20
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``written(name)`` -> (Written, tfport module), once per module."""
    return written_once(CASES, tmp_path_factory)


@pytest.mark.parametrize("name", sorted(CASES))
@torch.no_grad()
def test_matches_source_model(written, name):
    case = CASES[name]
    tiny, ours = written(name)
    for length in LENGTHS.get(name, (PROMPT,)):
        for padding in ("left", "right"):
            ids, mask = batch(padding, seed=80, length=length)
            extra = {"position_ids": positions_from_mask(mask, length)} if case.source.hf_position_ids else {}
            expected = tiny.hf(input_ids=ids, attention_mask=mask, **extra).logits
            logits, _ = ours(ids, mask)
            assert_close(logits, expected, mask.bool().numpy(), f"{name}, {length} tokens, {padding} padding")
    ids = batch("none", seed=81, length=length)[0][:1]  # the longest prompt
    tokens = tiny.hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=SMALL["pad_token_id"])[0, length:]
    assert generate(ours, ids, max_new_tokens=NEW_TOKENS)[0].tolist() == tokens.tolist(), name


def test_settings_read_from_the_file(written):
    """What each file's metadata and tensors became in tfport's config."""
    rope = written("llama3-rope-freqs")[1].config.rope
    assert (rope.scaling, rope.scaling_factor, rope.low_freq_factor, rope.high_freq_factor,
            rope.original_max_positions) == ("llama3", 8.0, 1.0, 8.0, 64)
    rope = written("qwen2-yarn")[1].config.rope
    assert (rope.scaling, rope.scaling_factor, rope.original_max_positions, rope.beta_fast) == ("yarn", 4.0, 16, 16.0)
    rope = written("phi3-longrope")[1].config.rope
    assert (rope.scaling, rope.original_max_positions, rope.long_factor) == \
        ("longrope", 8, tuple(_LONGROPE["long_factor"]))
    assert rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(64 / 8) / np.log(8)))
    assert written("phi3-longrope")[1].config.window.size is None  # the file's window of 0
    mistral = written("mistral-window")[1].config
    assert mistral.window.size == WINDOW and mistral.window.layers is None
    gemma = written("gemma2-pattern")[1].config
    assert gemma.window.layers == (1,) and (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (20.0, 10.0)
    assert written("gemma3-period")[1].config.window.layers == (0, 2)
    falcon = {name: written(name)[1].config for name in ("falcon-7b", "falcon-40b")}
    assert (falcon["falcon-7b"].kv_heads, falcon["falcon-40b"].kv_heads) == (1, 2)


@pytest.mark.parametrize("factor, original", [(8.0, 8192), (32.0, 8192)])  # Llama 3.1 / 3.3, 3.2
def test_llama3_parameters_of_released_files(factor, original):
    """rope_freqs as the converter writes it for Llama 3.x (head 128, base 500000) gives back
    their rope_scaling; the band holds several frequencies, so both unknowns are solved for."""
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original, "rope_theta": 500000.0}
    params = llama3_parameters(llama3_rope_freqs(rope, 128).astype(np.float64), 500000.0, 128, "test")
    assert params == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_rope_freqs_that_are_not_llama3_are_refused():
    rope = {**_LLAMA3, "rope_theta": 500000.0, "original_max_position_embeddings": 8192, "high_freq_factor": 4.0}
    factors = llama3_rope_freqs(rope, 128).astype(np.float64)
    factors[40] *= 1.5  # one divisor off the llama3 curve
    with pytest.raises(ValueError, match=r"rope_freqs\.weight: the divisors .* are not llama3"):
        llama3_parameters(factors, 500000.0, 128, "x.gguf: rope_freqs.weight")
    assert llama3_parameters(np.ones(64), 500000.0, 128, "x") is None  # all 1: no scaling


@pytest.mark.parametrize("base, metadata, message", [
    # YaRN without its trained context: the key is named (it used to read as a config.json error)
    ("qwen2-yarn", {"rope.scaling.original_context_length": None},
     r"refused\.gguf: qwen2\.rope\.scaling\.type='yarn' needs qwen2\.rope\.scaling\.original_context_length"),
    ("llama-linear", {"rope.scaling.type": "dynamic"},
     r"refused\.gguf: llama\.rope\.scaling\.type='dynamic' is not supported"),
    # refused by the Hugging Face importer, restated with the metadata key
    ("mpt", {"attention.clamp_kqv": 6.0},
     r"refused\.gguf: metadata mpt\.attention\.clamp_kqv \(as the Hugging Face config field "
     r"attn_config\.clip_qkv\): attn_config\.clip_qkv=6\.0 is not supported"),
    ("gpt2", {"context_length": 4},
     r"refused\.gguf: position_embd\.weight \(F16\) has shape \(64, 32\), expected \(4, 32\)"),
])
def test_refusals_name_the_file_and_its_key(tmp_path, base, metadata, message):
    case = CASES[base]
    case = dataclasses.replace(case, name="refused", metadata={**case.metadata, **metadata})
    with pytest.raises(ValueError, match=message) as refused:
        load_gguf(write_from_hf(case, tmp_path).path, tokenizer=False)
    assert "config.json" not in str(refused.value)
