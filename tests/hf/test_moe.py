"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) imported from tiny random
transformers checkpoints compute what transformers computes: prefill of a left- and a right-padded
batch (logits and the present KV), decode steps on the cache, a chunk on a past, greedy tokens.
The routing itself is checked against a numpy reference, and the configs against their fields.
The exported graphs are compared on every target in tests/export/test_moe_export.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tfport.config import ModelConfig
from tfport.config.moe import MoeConfig
from tfport.models.hf import hf_config_to_tfport, load_hf_model
from tfport.models.moe import MixtureOfExperts, routing_weights

from . import test_parity as dense_checks
from .cases import assert_close, batch, hf_decoder_step
from .moe_cases import MOE_CASES, importer

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")

PROMPT = 7


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return importer(lambda name: tmp_path_factory.mktemp(f"hf-{name}"))


def _numpy_routing(logits: np.ndarray, k: int, routing: str, normalize: bool) -> np.ndarray:
    """Dense routing weights [..., N] written from the definitions (tfport.config.moe)."""
    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    order = np.argsort(-logits, axis=-1)[..., :k]  # the top k experts (softmax keeps the order)
    if routing == "softmax_topk":
        top = np.take_along_axis(softmax(logits), order, -1)
        top = top / top.sum(-1, keepdims=True) if normalize else top
    else:
        top = softmax(np.take_along_axis(logits, order, -1))
    dense = np.zeros_like(logits)
    np.put_along_axis(dense, order, top, -1)
    return dense


@pytest.mark.parametrize("routing,normalize", [("softmax_topk", True), ("softmax_topk", False),
                                               ("topk_softmax", True)])
def test_routing_weights_match_numpy(routing, normalize):
    logits = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    ours = routing_weights(logits, 3, routing, normalize).numpy()
    expected = _numpy_routing(logits.numpy(), 3, routing, normalize)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-7)
    assert ((ours > 0).sum(-1) == 3).all()


# Each case's MoE settings as its fields in tests/hf/moe_cases.py say (and transformers' defaults):
# routing, renormalised top k, the MoE layers (None: every layer), shared expert (width, gated).
EXPECTED = {
    "mixtral": ("softmax_topk", True, None, (0, False)),
    "qwen2-moe": ("softmax_topk", False, (0,), (48, True)),
    "qwen3-moe": ("softmax_topk", True, (1,), (0, False)),
    "olmoe": ("softmax_topk", False, None, (0, False)),
    "granitemoe": ("topk_softmax", True, None, (0, False)),
}


def test_every_case_has_expectations():
    assert set(EXPECTED) == set(MOE_CASES)


@pytest.mark.parametrize("name", MOE_CASES)
def test_config_fields(moe, name):
    """The imported config names the family's experts, widths, routing and MoE layers."""
    it = moe(name)
    hf = it.hf.config
    config = it.model.config.moe
    routing, normalize, layers, shared = EXPECTED[name]
    assert config.n_experts == 4 and config.top_k == hf.num_experts_per_tok == 2
    assert (config.routing, config.normalize, config.layers) == (routing, normalize, layers)
    moe_layers = [i for i, layer in enumerate(it.model.decoder.layers) if isinstance(layer.ffn, MixtureOfExperts)]
    hf_moe_layers = [i for i, layer in enumerate(it.hf.model.layers)
                     if hasattr(getattr(layer, "mlp", None) or layer.block_sparse_moe, "experts")]
    assert moe_layers == hf_moe_layers
    assert (config.shared_d_ff, config.shared_gate) == shared
    assert ModelConfig.from_json(it.model.config.to_json()) == it.model.config


def test_olmoe_norms_span_all_heads_and_clip_bites(moe):
    """OLMoE's q/k norms are one RMSNorm over all heads' channels (H*D, Hkv*D), and the case's
    clip_qkv clamps some of the normalised queries (so the parity tests exercise it)."""
    it = moe("olmoe")
    config, attn = it.model.config, it.model.decoder.layers[0].attn
    assert (config.qk_norm, config.qk_norm_span, config.qkv_clip) == (True, "all_heads", 1.5)
    hf_attn = it.hf.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == hf_attn.q_norm.weight.shape == (4 * 16,)
    assert attn.k_norm.weight.shape == hf_attn.k_norm.weight.shape == (2 * 16,)
    ids, _ = batch("left", seed=30, length=PROMPT)
    with torch.no_grad():
        states = it.model.decoder.layers[0].attn_norm(it.model.decoder.embed.tokens(ids))
        q = attn.q_norm(attn.qkv(states)[..., :64])  # [B, S, H*D] before the clamp
    assert 0 < (q.abs() > 1.5).float().mean() < 0.5


@pytest.mark.parametrize("name", MOE_CASES)
def test_routing_is_not_trivial(moe, name):
    """The perturbed routers send different tokens to different experts (a wrong expert mapping
    would then show in the logits)."""
    it = moe(name)
    ids, mask = batch("left", seed=30, length=PROMPT)
    layer = next(layer for layer in it.model.decoder.layers if isinstance(layer.ffn, MixtureOfExperts))
    states = it.model.decoder.embed.tokens(ids)
    chosen = routing_weights(layer.ffn.router(states), 2, "softmax_topk", True) > 0  # [B, S, N]
    assert len({tuple(row) for row in chosen.reshape(-1, 4).tolist()}) > 2
    assert chosen.any(dim=(0, 1)).all()  # every expert is used by some token


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name", MOE_CASES)
def test_prefill(moe, name, padding):
    """Logits and every layer's present KV, as the dense decoders' check (test_parity.py)."""
    dense_checks.test_decoder_prefill(moe, name, padding)


@pytest.mark.parametrize("name", MOE_CASES)
def test_decode_steps_and_chunk(moe, name):
    """Left-padded prefill, three greedy single-token steps (the same tokens on both sides), then
    a chunk of three tokens on that past."""
    it = moe(name)
    ids, mask = batch("left", seed=32, length=PROMPT)
    logits, cache = it.model(ids, mask)
    expected, hf_cache = hf_decoder_step(it.hf, it.case, ids, mask)
    for step in range(3):
        token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        assert torch.equal(token, expected[:, -1].argmax(-1, keepdim=True)), f"{name} greedy step {step}"
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits, cache = it.model(token, mask, past_key_values=cache)
        expected, hf_cache = hf_decoder_step(it.hf, it.case, token, mask, hf_cache)
        assert_close(logits, expected, np.ones((2, 1), bool), f"{name} decode step {step}")
    chunk = torch.randint(3, 96, (2, 3), generator=torch.Generator().manual_seed(33))
    mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
    logits, _ = it.model(chunk, mask, past_key_values=cache)
    expected, _ = hf_decoder_step(it.hf, it.case, chunk, mask, hf_cache)
    assert_close(logits, expected, np.ones((2, 3), bool), f"{name} chunk on a past")


def test_gpt_oss_is_refused_with_the_reason(tmp_path):
    """A gpt-oss checkpoint (its config as transformers writes it) is refused before its weights
    are opened, saying what tfport lacks."""
    transformers.GptOssConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json: model_type='gpt_oss' is not supported: .*attention "
                       r"sinks .*self_attn\.sinks.*clamped SwiGLU .*swiglu_limit.*MXFP4"):
        load_hf_model(tmp_path)  # no weights in the directory: the config alone is refused
    hf = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model_type='gpt_oss' is not supported"):
        hf_config_to_tfport(hf)


def test_refusals():
    """What the config refuses, naming the field and what was expected."""
    with pytest.raises(ValueError, match=r"config\.moe\.top_k=5: expected experts per token in \[1, n_experts=4\]"):
        MoeConfig(n_experts=4, top_k=5, d_expert=8)
    with pytest.raises(ValueError, match=r"config\.moe\.top_k=2: expected the default unless moe\.n_experts > 0"):
        MoeConfig(top_k=2)
    with pytest.raises(ValueError, match=r"config\.moe\.routing='top1'"):
        MoeConfig(n_experts=4, top_k=1, d_expert=8, routing="top1")
    with pytest.raises(ValueError, match=r"config\.moe\.layers=\(2,\): expected distinct layer indices in \[0, 2\)"):
        ModelConfig(family="decoder", vocab_size=8, d_model=8, n_heads=2, d_ff=8, n_decoder_layers=2,
                    moe=MoeConfig(n_experts=2, top_k=1, d_expert=4, layers=(2,)))
    with pytest.raises(ValueError, match=r"config\.json: decoder_sparse_step=0 is not supported"):
        hf_config_to_tfport({"model_type": "qwen2_moe", "hidden_size": 8, "num_attention_heads": 2,
                             "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
                             "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 4,
                             "decoder_sparse_step": 0})
    decoder = dict(family="decoder", vocab_size=8, d_model=8, n_heads=2, d_ff=8, n_decoder_layers=1,
                   norm="rmsnorm")
    with pytest.raises(ValueError, match=r"config\.qk_norm_span='all_heads': expected 'head' unless qk_norm"):
        ModelConfig(**decoder, qk_norm_span="all_heads")
    with pytest.raises(ValueError, match=r"config\.qkv_clip=0: expected a positive finite number or null"):
        ModelConfig(**decoder, qkv_clip=0)
    with pytest.raises(ValueError, match=r"config\.residual_scale=0\.5: expected 1\.0 unless a pre-norm block"):
        ModelConfig(**{**decoder, "norm_position": "post"}, residual_scale=0.5)
    granite = {"model_type": "granitemoe", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 8,
               "intermediate_size": 8, "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1}
    with pytest.raises(ValueError, match=r"config\.json: logits_scaling=0 is not supported .*positive number"):
        hf_config_to_tfport({**granite, "logits_scaling": 0})
    with pytest.raises(ValueError, match=r"config\.json: head_dim=8 is not supported for model_type='olmoe'"):
        hf_config_to_tfport({"model_type": "olmoe", "hidden_size": 8, "num_attention_heads": 2, "head_dim": 8,
                             "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_experts": 2,
                             "num_experts_per_tok": 1})


def test_stacked_experts_are_shape_checked(moe, tmp_path):
    """Granite-MoE's stacked experts: a stack with an expert missing is named with the shape
    expected, before anything is read."""
    from safetensors.torch import load_file, save_file

    it = moe("granitemoe")
    tensors = load_file(it.directory / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.input_linear.weight"
    tensors[key] = tensors[key][:3].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((it.directory / "config.json").read_text())
    with pytest.raises(ValueError, match=r"input_linear\.weight has shape \(3, 64, 64\), expected \(4, 64, 64\)"):
        load_hf_model(tmp_path)
