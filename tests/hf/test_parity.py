"""Imported checkpoints compute what transformers computes: prefill with left and right padding,
decode steps on the cache, and the ONNX export of the imported module.

Positions: tfport counts them from the attention mask (cumsum - 1, at least 0), so LLaMA/Mistral
and GPT-2 get the same position_ids; BERT's default positions 0..S-1 agree under right padding;
BLOOM and MPT (ALiBi) take none.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tfport.contract import LAST_LOGITS
from tfport.export import export_model
from tfport.manifest import Manifest
from tfport.models.positions import positions_from_mask

from .cases import CASES, assert_close, batch, hf_decoder_step, hf_encoder, hf_layer_kv

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")

DECODERS = [name for name, case in CASES.items() if case.decoder]
# One ONNX comparison per architecture (the tied/biased LLaMA variant adds nothing to the graph).
# The deployed decoders (issue #12) have their graph and runtime tests per target in test_decoders.
ONNX_CASES = [name for name in CASES if name != "llama-mqa-bias-tied" and not CASES[name].per_target]


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name", DECODERS)
def test_decoder_prefill(imported, name, padding):
    it = imported(name)
    ids, mask = batch(padding, seed=11)
    logits, cache = it.model(ids, mask)
    hf_logits, hf_cache = hf_decoder_step(it.hf, it.case, ids, mask)
    real = mask.bool().numpy()
    assert_close(logits, hf_logits, real, f"{name} logits")
    for layer in range(it.model.config.n_decoder_layers):
        for part, ours, theirs in zip("kv", cache.layers[layer], hf_layer_kv(hf_cache, layer)):
            # transformers keeps only the last window - 1 keys of a sliding-window layer; tfport
            # keeps them all. Compare the slots both hold.
            kept = theirs.shape[2]
            if theirs.shape[1] != ours.shape[1]:  # Falcon's new architecture caches K/V per query head
                ours = ours.repeat_interleave(theirs.shape[1] // ours.shape[1], dim=1)
            # [B, Hkv, T, D] -> [B, T, Hkv, D] so that the real-position mask [B, T] applies
            assert_close(ours[:, :, -kept:].transpose(1, 2), theirs.transpose(1, 2), real[:, -kept:],
                         f"{name} layer {layer} {part}")


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_decode_steps(imported, name):
    """Left-padded prefill, then three single-token steps on the cache."""
    it = imported(name)
    ids, mask = batch("left", seed=12)
    logits, cache = it.model(ids, mask)
    hf_logits, hf_cache = hf_decoder_step(it.hf, it.case, ids, mask)
    for step in range(3):
        token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1], the same token for both
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits, cache = it.model(token, mask, past_key_values=cache)
        hf_logits, hf_cache = hf_decoder_step(it.hf, it.case, token, mask, hf_cache)
        assert cache.length == mask.shape[1]
        assert_close(logits, hf_logits, np.ones((2, 1), bool), f"{name} decode step {step}")


@pytest.mark.parametrize("padding", ["right", "left"])
def test_encoder(imported, padding):
    """BERT: states, pooler and MLM logits. HF BERT counts positions 0..S-1 whatever the padding,
    so under left padding it is given tfport's positions."""
    it = imported("bert")
    ids, mask = batch(padding, seed=13)
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    out = it.model(ids, mask, types)
    position_ids = positions_from_mask(mask, ids.shape[1]) if padding == "left" else None
    expected = hf_encoder(it.hf, ids, mask, types, position_ids)
    real = mask.bool().numpy()
    assert_close(out.last_hidden_state, expected["last_hidden_state"], real, "last_hidden_state")
    assert_close(out.logits, expected["logits"], real, "mlm logits")
    if padding == "right":  # the pooler reads position 0, a real token only under right padding
        assert_close(out.pooler_output, expected["pooler_output"], np.ones(2, bool), "pooler_output")


def onnx_feeds(manifest: Manifest, graph: str, ids, mask, extra: dict) -> dict[str, np.ndarray]:
    """Inputs per tfport.contract: ids, mask, position_ids counted from the mask, empty past,
    every position's logits (``last_logits`` false)."""
    spec = manifest.graphs[graph]
    config = manifest.config
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), **extra}
    if spec.input(LAST_LOGITS) is not None:
        feeds[LAST_LOGITS] = np.array(False)
    if spec.input("position_ids") is not None:
        feeds["position_ids"] = positions_from_mask(mask, ids.shape[1]).numpy()
    for t in spec.inputs:
        if t.name.startswith("past_key_values."):
            feeds[t.name] = np.zeros((ids.shape[0], config.kv_heads, 0, config.dim_per_head), np.float32)
    assert set(feeds) == {t.name for t in spec.inputs}
    return feeds


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_export_matches_transformers(imported, tmp_path, name):
    """Export the imported module (validated against itself), then ONNX Runtime vs transformers."""
    it = imported(name)
    manifest = export_model(it.model, tmp_path / "export")
    graph = "decoder" if it.case.decoder else "encoder"
    session = ort.InferenceSession(str(tmp_path / "export" / manifest.graphs[graph].file),
                                   providers=["CPUExecutionProvider"])
    padding = "left" if it.case.decoder else "right"
    ids, mask = batch(padding, seed=14)
    real = mask.bool().numpy()
    if it.case.decoder:
        feeds = onnx_feeds(manifest, graph, ids, mask, {})
        logits = session.run(["logits"], feeds)[0]  # [B, S, V]
        expected, _ = hf_decoder_step(it.hf, it.case, ids, mask)
        assert_close(logits, expected, real, f"{name} onnx logits")
        # the head on the last position alone (prompts are left-padded: S - 1), as a prefill asks
        last = session.run(["logits"], {**feeds, LAST_LOGITS: np.array(True)})[0]  # [B, 1, V]
        assert_close(last, expected[:, -1:], real[:, -1:], f"{name} onnx last-position logits")
    else:
        types = torch.zeros_like(ids)
        outputs = session.run(None, onnx_feeds(manifest, graph, ids, mask, {"token_type_ids": types.numpy()}))
        got = dict(zip([o.name for o in session.get_outputs()], outputs))
        expected = hf_encoder(it.hf, ids, mask, types)
        assert_close(got["last_hidden_state"], expected["last_hidden_state"], real, "onnx states")
        assert_close(got["logits"], expected["logits"], real, "onnx mlm logits")
        assert_close(got["pooler_output"], expected["pooler_output"], np.ones(2, bool), "onnx pooler")
