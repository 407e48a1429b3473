"""Encoder states and sentence embeddings equal the PyTorch EncoderModel's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

# {dtype: (rtol, atol)}
TOLERANCE = {
    # float32 ONNX Runtime vs PyTorch on the CPU: same math, different kernels and summation
    # order (fused LayerNorm, GELU); a few ulps of E=32 accumulations.
    "float32": (1e-4, 1e-5),
}
PROMPTS = [[1, 5, 7, 9, 11, 13], [1, 20, 3], [4]]


@dataclass(frozen=True)
class PoolCase:
    pooling: str
    normalize: bool


def torch_states(exported, prompt, token_types=None):
    """Reference EncoderOutput for one unpadded prompt."""
    ids = torch.tensor([prompt])
    types = None if token_types is None else torch.tensor([token_types])
    with torch.no_grad():
        return exported.model(ids, torch.ones_like(ids), types)


def test_states_pooler_logits(loaded):
    exported, model = loaded("encoder")
    rtol, atol = TOLERANCE["float32"]
    out = model.encode(PROMPTS)
    assert out.last_hidden_state.shape == (3, 6, model.config.d_model)  # [B, S, E] right-padded
    np.testing.assert_array_equal(out.attention_mask.sum(1), [6, 3, 1])
    for b, prompt in enumerate(PROMPTS):
        ref = torch_states(exported, prompt)
        n = len(prompt)
        np.testing.assert_allclose(out.last_hidden_state[b, :n], ref.last_hidden_state[0].numpy(),
                                   rtol=rtol, atol=atol)
        np.testing.assert_allclose(out.pooler_output[b], ref.pooler_output[0].numpy(),
                                   rtol=rtol, atol=atol)
        np.testing.assert_allclose(out.logits[b, :n], ref.logits[0].numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", [PoolCase("mean", False), PoolCase("mean", True),
                                  PoolCase("cls", False), PoolCase("cls", True)],
                         ids=lambda c: f"{c.pooling}-{'norm' if c.normalize else 'raw'}")
def test_embeddings(case, loaded):
    exported, model = loaded("encoder")
    rtol, atol = TOLERANCE["float32"]
    got = model.embed(PROMPTS, pooling=case.pooling, normalize=case.normalize)
    assert got.shape == (3, model.config.d_model) and got.dtype == np.float32
    for b, prompt in enumerate(PROMPTS):
        states = torch_states(exported, prompt).last_hidden_state[0]  # [S, E]
        expected = states.mean(0) if case.pooling == "mean" else states[0]
        if case.normalize:
            expected = torch.nn.functional.normalize(expected, dim=-1)
        np.testing.assert_allclose(got[b], expected.numpy(), rtol=rtol, atol=atol)


def test_token_types(loaded):
    exported, model = loaded("encoder")
    rtol, atol = TOLERANCE["float32"]
    types = [[0, 0, 0, 1, 1, 1], [0, 1, 1], [1]]
    out = model.encode(PROMPTS, token_type_ids=types)
    for b, (prompt, t) in enumerate(zip(PROMPTS, types)):
        ref = torch_states(exported, prompt, t).last_hidden_state[0].numpy()
        np.testing.assert_allclose(out.last_hidden_state[b, :len(prompt)], ref,
                                   rtol=rtol, atol=atol)
    assert not np.allclose(out.last_hidden_state[0], model.encode(PROMPTS).last_hidden_state[0])


def test_left_padded_array_is_repadded(loaded):
    _, model = loaded("encoder")
    ids = np.array([[0, 0, 1, 20, 3], [1, 5, 7, 9, 11]])
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_allclose(model.embed(ids, mask, pooling="cls"),
                               model.embed([[1, 20, 3], [1, 5, 7, 9, 11]], pooling="cls"),
                               rtol=1e-5, atol=1e-6)


def test_encoder_decoder_exposes_its_encoder_states(loaded):
    exported, model = loaded("encoder-decoder")
    with torch.no_grad():
        ref = exported.model.encode(torch.tensor([PROMPTS[0]])).numpy()
    np.testing.assert_allclose(model.encode([PROMPTS[0]]).last_hidden_state, ref,
                               rtol=1e-4, atol=1e-5)
