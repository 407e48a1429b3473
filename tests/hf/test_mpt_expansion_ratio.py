"""MPT's ``expansion_ratio``: transformers' MPT ignores it (its MLP is always 4x the width), so a
checkpoint saved with expansion_ratio 2 holds 4x MLP weights; tfport follows transformers and
imports it (it used to read the ratio and refuse the checkpoint with a shape mismatch)."""

from __future__ import annotations

import json

import torch

from tfport.models.hf import load_hf_model

from .cases import SMALL, assert_close, batch, perturbed_model, save_hf


@torch.no_grad()
def test_mpt_ignores_expansion_ratio(tmp_path):
    hf = perturbed_model("MptConfig", "MptForCausalLM", seed=90, **SMALL, d_model=32, n_layers=2,
                         n_heads=4, max_seq_len=64, expansion_ratio=2)
    save_hf(hf, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["expansion_ratio"] == 2
    assert hf.transformer.blocks[0].ffn.up_proj.out_features == 4 * 32  # what transformers built
    ours = load_hf_model(tmp_path)
    assert ours.config.d_ff == 4 * 32
    ids, mask = batch("right", seed=91, length=7)
    assert_close(ours(ids, mask)[0], hf(input_ids=ids, attention_mask=mask).logits,
                 mask.bool().numpy(), "MPT with expansion_ratio 2")
