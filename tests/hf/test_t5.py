"""T5 import: relative position bias, gated and ungated FFN, tied (scaled) and untied heads,
compared with transformers' T5ForConditionalGeneration (tiny, random, offline)."""

from __future__ import annotations

import json

import pytest
import torch

from tfport.export import export_model
from tfport.models.hf import load_hf_model
from tfport.runtime import load_model

from .cases import TOLERANCE

# (feed_forward_proj, tie_word_embeddings in config.json, separate lm_head tensor in the file)
VARIANTS = {
    "v1.0-relu-tied": ("relu", True, False),  # head = shared, output scaled by d_model^-0.5
    "v1.1-gated-gelu": ("gated-gelu", False, False),  # as transformers 5 saves it: tied, unscaled
    "v1.1-untied-head": ("gated-gelu", False, True),  # original v1.1 files: their own lm_head
}


def build(variant: str, directory):
    """A random transformers T5 saved as safetensors in ``directory``; returns the HF model."""
    from safetensors.torch import save_file
    from transformers import T5Config, T5ForConditionalGeneration

    proj, tie, own_head = VARIANTS[variant]
    config = T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                      feed_forward_proj=proj, tie_word_embeddings=tie, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, variant)))
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1: perturb so a wrong mapping shows
            p.add_(torch.randn_like(p) * 0.1)
        if own_head:
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight))
    if own_head:  # write what an untied checkpoint holds: every tensor once, lm_head included
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not k.endswith("embed_tokens.weight")}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config.to_dict()))
    else:
        model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, directory)
    return request.param, hf, load_hf_model(directory)


ENCODER_IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 0, 0, 0]])
ENCODER_MASK = (torch.arange(8) < torch.tensor([[8], [5]])).long()  # right padding
DECODER_IDS = torch.tensor([[0, 20, 21, 22, 23], [0, 30, 31, 32, 33]])


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    rtol, atol = TOLERANCE
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=what)


@torch.no_grad()
def test_config_maps_the_variant(pair):
    variant, hf, model = pair
    proj, tie, own_head = VARIANTS[variant]
    c = model.config
    assert (c.family, c.position, c.norm, c.attention_scale) == ("encoder-decoder", "relative", "rmsnorm", 1.0)
    assert c.gated_ffn == proj.startswith("gated") and c.tie_embeddings == (not own_head)
    assert c.lm_head_scale == (32**-0.5 if tie else 1.0)
    assert (c.relative.buckets, c.relative.max_distance, c.n_decoder_layers) == (8, 20, 3)


@torch.no_grad()
def test_teacher_forced_logits_match(pair):
    variant, hf, model = pair
    expected = hf(input_ids=ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=DECODER_IDS).logits
    actual = model(ENCODER_IDS, DECODER_IDS, attention_mask=ENCODER_MASK)
    close(actual, expected, variant)


@torch.no_grad()
def test_decode_steps_with_cache_match(pair):
    variant, hf, model = pair
    expected = hf(input_ids=ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=DECODER_IDS).logits
    memory = model.cross_kv(model.encode(ENCODER_IDS, ENCODER_MASK))
    logits, cache = model.decode(DECODER_IDS[:, :2], memory, ENCODER_MASK)
    close(logits, expected[:, :2], f"{variant} prefill")
    for step in range(2, DECODER_IDS.shape[1]):
        logits, cache = model.decode(DECODER_IDS[:, step:step + 1], memory, ENCODER_MASK,
                                     past_key_values=cache)
        close(logits[:, 0], expected[:, step], f"{variant} step {step}")


@torch.no_grad()
def test_exported_graphs_generate_like_transformers(pair, tmp_path):
    variant, hf, model = pair
    export_model(model, tmp_path / "t5")  # validated against the imported module
    runtime = load_model(tmp_path / "t5")
    rows = [ENCODER_IDS[0].tolist(), ENCODER_IDS[1, :5].tolist()]
    tokens = runtime.generate(rows, max_new_tokens=8, stop_token_ids=())
    for row, ids in zip(tokens, rows):
        decoded = [hf.config.decoder_start_token_id]
        for _ in range(8):  # transformers greedy, recomputed from scratch each step (no cache)
            logits = hf(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([decoded])).logits
            decoded.append(int(logits[0, -1].argmax()))
        assert row.tolist() == decoded[1:], variant
