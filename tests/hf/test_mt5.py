"""mT5 import (T5 v1.1 layout: gated GELU, untied head, unscaled output) against transformers'
MT5ForConditionalGeneration: teacher-forced logits, decode steps on the cache, and greedy
generation of the export under the runtime (prompts of different lengths, right padding)."""

from __future__ import annotations

import pytest
import torch

from tfport.export import export_model
from tfport.models.hf import load_hf_model
from tfport.runtime import load_model

from .test_t5 import DECODER_IDS, ENCODER_IDS, ENCODER_MASK, close

transformers = pytest.importorskip("transformers", reason="compared against transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    config = transformers.MT5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(7)
    hf = transformers.MT5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters()):
            p.add_(torch.randn_like(p) * 0.1)
    directory = tmp_path_factory.mktemp("mt5")
    hf.save_pretrained(directory)
    return hf, load_hf_model(directory)


@torch.no_grad()
def test_mt5_matches_transformers(pair):
    hf, model = pair
    c = model.config
    assert c.gated_ffn and c.activation == "gelu_tanh" and c.lm_head_scale == 1.0
    expected = hf(input_ids=ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=DECODER_IDS).logits
    close(model(ENCODER_IDS, DECODER_IDS, attention_mask=ENCODER_MASK), expected, "teacher forced")
    memory = model.cross_kv(model.encode(ENCODER_IDS, ENCODER_MASK))
    logits, cache = model.decode(DECODER_IDS[:, :2], memory, ENCODER_MASK)
    for step in range(2, DECODER_IDS.shape[1]):
        logits, cache = model.decode(DECODER_IDS[:, step:step + 1], memory, ENCODER_MASK, past_key_values=cache)
        close(logits[:, 0], expected[:, step], f"step {step}")


@torch.no_grad()
def test_mt5_export_generates_like_transformers(pair, tmp_path):
    """Greedy with the runtime's cache vs transformers' generate (its own cache)."""
    hf, model = pair
    export_model(model, tmp_path / "mt5")
    rows = [ENCODER_IDS[0].tolist(), ENCODER_IDS[1, :5].tolist()]
    tokens = load_model(tmp_path / "mt5").generate(rows, max_new_tokens=8, stop_token_ids=())
    expected = hf.generate(input_ids=ENCODER_IDS, attention_mask=ENCODER_MASK, max_new_tokens=8,
                           min_new_tokens=8, do_sample=False, num_beams=1)
    assert tokens.tolist() == expected[:, 1:].tolist()
