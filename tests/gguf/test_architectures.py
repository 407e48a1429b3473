"""Every GGUF architecture tfport maps, one tiny file each (written from a tiny transformers model
by ``from_hf``): tfport's import against transformers' own GGUF loading of the same file and
against the model the file was written from, on a left- and a right-padded batch, and greedy
tokens; Gemma's query scale inferred as llama.cpp infers it.

Where transformers' GGUF loader cannot read an architecture (Gemma 1) or drops metadata the file
holds (Phi-3's sliding window, Gemma 3's RoPE scaling), the case says so and is compared with the
source model only.
"""

from __future__ import annotations

import pytest

from tfport.models.gguf import ARCHITECTURES
from tfport.models.gguf.architectures import NOT_YET_SUPPORTED, gemma_query_scalar

from ..hf.cases import WINDOW, HFCase
from .from_hf import GGUFCase, assert_import_matches, written_once

_SIZE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# transformers' GGUF loader does not read attention.key_length for Qwen3 nor
# query_pre_attn_scalar for Gemma 2/3 (neither is stored): it keeps the config defaults, head_dim
# 128 and query_pre_attn_scalar 256, so the cases use those values.
_GEMMA = dict(_SIZE, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
              query_pre_attn_scalar=256, sliding_window=WINDOW)
_NO_PHI2 = "transformers' GGUF loader has no 'phi2' architecture"

CASES = {case.name: case for case in [
    GGUFCase("qwen2", "qwen2", HFCase("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(
        _SIZE, tie_word_embeddings=True), seed=40), weight_type="F16"),
    GGUFCase("qwen3", "qwen3", HFCase("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(
        _SIZE, head_dim=128), seed=41)),
    GGUFCase("gemma", "gemma", HFCase("gemma", "GemmaForCausalLM", "GemmaConfig", dict(
        _SIZE, head_dim=32), seed=42),
        transformers_differs="transformers' GGUF loader has no 'gemma' (Gemma 1) architecture"),
    # Gemma 2: llama.cpp's soft-capping defaults (50 / 30), which transformers' loader assumes.
    GGUFCase("gemma2", "gemma2", HFCase("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(
        _GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0), seed=43),
        weight_type="F16", metadata={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # 6 layers: five sliding ones (base 10000), one global (rope.freq_base).
    GGUFCase("gemma3", "gemma3", HFCase("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        _GEMMA, num_hidden_layers=6, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), seed=44)),
    GGUFCase("gemma3-linear-rope", "gemma3", HFCase("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        _GEMMA, num_hidden_layers=6, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), seed=45),
        transformers_differs="transformers' GGUF loader drops gemma3.rope.scaling.*"),
    GGUFCase("phi3", "phi3", HFCase("phi3", "Phi3ForCausalLM", "Phi3Config", dict(
        _SIZE, sliding_window=None), seed=46)),
    GGUFCase("phi3-window", "phi3", HFCase("phi3", "Phi3ForCausalLM", "Phi3Config", dict(
        _SIZE, sliding_window=WINDOW), seed=47), weight_type="F16",
        transformers_differs="transformers' GGUF loader drops phi3.attention.sliding_window"),
    # StableLM: transformers' loader ignores rope.dimension_count, keeping the config default of
    # a quarter of each head rotated, which the cases keep; q/k/v biases, sequential and parallel
    # residual, told apart by the tensors present.
    GGUFCase("stablelm", "stablelm", HFCase("stablelm", "StableLmForCausalLM", "StableLmConfig", dict(
        _SIZE, use_qkv_bias=True), seed=48)),
    GGUFCase("stablelm-parallel", "stablelm", HFCase("stablelm", "StableLmForCausalLM", "StableLmConfig",
        dict(_SIZE, use_parallel_residual=True), seed=49), weight_type="F16"),
    # Phi-2 as the converter writes it: 4x MLP, MHA, no rope.freq_base (llama.cpp's 10000); half
    # of each head rotated; then Phi-2's original layout (one fused attn_qkv), whole heads rotated.
    GGUFCase("phi2", "phi2", HFCase("phi", "PhiForCausalLM", "PhiConfig", dict(
        _SIZE, intermediate_size=256, num_key_value_heads=4, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), seed=73),
        metadata={"rope.freq_base": None}, transformers_differs=_NO_PHI2),
    GGUFCase("phi2-fused-qkv", "phi2", HFCase("phi", "PhiForCausalLM", "PhiConfig", dict(
        _SIZE, intermediate_size=256, num_key_value_heads=4, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}), seed=74),
        weight_type="F16", metadata={"rope.freq_base": None}, fused_qkv=True, transformers_differs=_NO_PHI2),
    # StarCoder2: biases and tied head (its defaults), then neither, with a RoPE base of its own.
    GGUFCase("starcoder2", "starcoder2", HFCase("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config",
        dict(_SIZE), seed=75)),
    GGUFCase("starcoder2-no-bias", "starcoder2", HFCase("starcoder2", "Starcoder2ForCausalLM",
        "Starcoder2Config", dict(_SIZE, use_bias=False, tie_word_embeddings=False, rope_parameters={
            "rope_type": "default", "rope_theta": 100000.0}), seed=76), weight_type="F16",
        transformers_differs="transformers' GGUF loader drops starcoder2.rope.freq_base"),
]}
# (rtol, atol): tests.hf.cases.TOLERANCE, float32 on CPU (same function, different op order).


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``written(name)`` -> (Written, tfport module), once per module."""
    return written_once(CASES, tmp_path_factory)


def test_every_architecture_has_a_case():
    from .test_downloaded import CASES as DOWNLOADED  # gpt2, bloom, mpt, falcon; RoPE scalings
    from .test_moe import CASES as MOE  # qwen2moe, qwen3moe; llama with experts

    cases = {case.arch for case in (*CASES.values(), *DOWNLOADED.values(), *MOE.values())}
    assert cases == set(ARCHITECTURES)  # llama: test_tiny.py too
    assert not set(ARCHITECTURES) & set(NOT_YET_SUPPORTED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_matches(written, name):
    assert_import_matches(name, CASES[name], *written(name), seed=50)


def test_gguf_config_fields(written):
    """What the metadata and llama.cpp's conventions give the HF importer."""
    tiny, ours = written("gemma2")
    config = ours.config
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.tie_embeddings and config.window.size == WINDOW
    _, phi3 = written("phi3-window")
    assert phi3.config.window.size == WINDOW


@pytest.mark.parametrize("model_type, layers, hidden, heads, head_dim, expected", [
    # the HF configs' query_pre_attn_scalar of each released size
    ("gemma2", 26, 2304, 8, 256, 256),     # gemma-2-2b
    ("gemma2", 42, 3584, 16, 256, 256),    # gemma-2-9b
    ("gemma2", 46, 4608, 32, 128, 144),    # gemma-2-27b
    ("gemma3_text", 26, 1152, 4, 256, 256),   # gemma-3-1b
    ("gemma3_text", 34, 2560, 8, 256, 256),   # gemma-3-4b
    ("gemma3_text", 62, 5376, 32, 128, 168),  # gemma-3-27b
])
def test_gemma_query_scalar(model_type, layers, hidden, heads, head_dim, expected):
    config = {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
              "num_attention_heads": heads, "head_dim": head_dim}
    assert gemma_query_scalar(config) == {"query_pre_attn_scalar": expected}


def test_stablelm_layout_from_tensors(written):
    for name, parallel, bias in (("stablelm", False, True), ("stablelm-parallel", True, False)):
        config = written(name)[1].config
        assert (config.parallel_residual, config.attention_bias) == (parallel, bias), name


def test_phi2_and_starcoder2_layouts_from_metadata_and_tensors(written):
    """Rotary channels from rope.dimension_count (the whole head when it equals the head
    dimension, where transformers' Phi alone would rotate half); biases from the tensors present."""
    assert written("phi2")[1].config.rope.rotary_dim == 8  # half of a 16-channel head
    assert written("phi2-fused-qkv")[1].config.rope.rotary_dim is None  # all 16
    for name, bias, tied in (("starcoder2", True, True), ("starcoder2-no-bias", False, False)):
        config = written(name)[1].config
        assert (config.attention_bias, config.mlp_bias, config.tie_embeddings) == (bias, bias, tied), name
