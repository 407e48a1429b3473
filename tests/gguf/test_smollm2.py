"""SmolLM2-135M-Instruct (Q4_1 / Q8_0 GGUF, LLaMA architecture, GQA, tied embeddings): tfport's
GGUF import against transformers' GGUF import of the same file -- the same dequantised weights,
so logits agree to float32 rounding and greedy tokens are identical -- directly and through the
export and the torch-free runtime."""

from __future__ import annotations

import pytest
import torch

from tfport.models.generate import generate
from tfport.models.gguf import hf_config
from tfport.models.gguf.architectures import LLAMA

from .smollm2 import smollm2_file

# Chat-formatted and plain prompts (token ids from the GGUF tokenizer; see test_tokenizer.py).
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colours are",
]
NEW_TOKENS = 8
EOS = 2  # <|im_end|>
# fp32 logits of two float32 implementations of the same weights: summation order differs
# (fused QKV and gate/up matmuls in tfport, separate ones in transformers); observed max |diff|
# ~5e-5 on logits of magnitude ~40.
LOGITS_ATOL, LOGITS_RTOL = 5e-4, 1e-4


def test_config_from_metadata():
    config = hf_config(smollm2_file(), LLAMA)
    expected = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
                "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "rope_theta": 100000.0, "max_position_embeddings": 8192, "vocab_size": 49152,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": 2, "hidden_act": "silu"}
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


@pytest.fixture(scope="module")
def prompts(smollm2_hf_tokenizer) -> list[list[int]]:
    return [smollm2_hf_tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_hf, prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: NEW_TOKENS tokens, or fewer ending
    with EOS."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out.append(smollm2_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                       [0, len(prompt):].tolist())
    return out


def _until_eos(tokens, eos: int = EOS) -> list[int]:
    tokens = [int(t) for t in tokens]
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@torch.no_grad()
def test_logits_and_greedy_tokens_match_transformers(smollm2, smollm2_hf, prompts, hf_greedy):
    model = smollm2.model
    assert model.config.tie_embeddings and model.config.n_kv_heads == 3
    for prompt, expected in zip(prompts, hf_greedy):
        ids = torch.tensor([prompt])
        ours, _ = model(ids)
        theirs = smollm2_hf(ids).logits
        torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
        got = generate(model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=EOS)[0]
        assert _until_eos(got) == expected


def test_export_runtime_greedy_matches_transformers(smollm2_dir, prompts, hf_greedy):
    from tfport.runtime import load_model

    runtime = load_model(smollm2_dir)
    tokens = runtime.generate(prompts, max_new_tokens=NEW_TOKENS)  # stops at EOS, then pads
    assert [_until_eos(row) for row in tokens] == hf_greedy
