"""Tiny random mixture-of-experts models of each family transformers has and tfport imports:
the cases (``cases.HFCase``, every parameter perturbed, routers included, so that routing differs
from token to token) and a cache of their imports, shared by tests/hf/test_moe.py and
tests/export/test_moe_export.py."""

from __future__ import annotations

from pathlib import Path

from tfport.models.hf import load_hf_model

from .cases import HFCase, build_hf, save_hf

# Head dimension 16 so that every export target, ONNX Runtime's fused attention included, takes
# them; 4 experts, 2 per token.
_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_experts_per_tok=2)

MOE_CASES = {case.name: case for case in [
    # Softmax over all experts, top 2, renormalised; every layer a mixture.
    HFCase("mixtral", "MixtralForCausalLM", "MixtralConfig", dict(
        **_MOE, intermediate_size=48, num_local_experts=4), seed=40),
    # A shared expert behind a sigmoid gate, top-2 weights not renormalised; layer 1 dense
    # (mlp_only_layers) with its own width.
    HFCase("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        **_MOE, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, norm_topk_prob=False, mlp_only_layers=[1]), seed=41),
    # Per-head q/k norms, renormalised top 2; decoder_sparse_step 2: layer 0 dense, layer 1 a mixture.
    HFCase("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        **_MOE, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        norm_topk_prob=True, decoder_sparse_step=2), seed=42),
    # q/k norms over all heads' channels, q/k/v clamped at 1.5 (after the norms: a few percent
    # of the values clip), top-2 weights not renormalised (OLMoE's default); every layer a mixture.
    HFCase("olmoe", "OlmoeForCausalLM", "OlmoeConfig", dict(
        **_MOE, intermediate_size=32, num_experts=4, clip_qkv=1.5), seed=43),
    # Softmax over the top-2 logits; experts stacked (input_linear [N, 2F, E]); Granite's four
    # multipliers away from 1 (the attention one away from 1/sqrt(16) too).
    HFCase("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", dict(
        **_MOE, intermediate_size=32, num_local_experts=4, embedding_multiplier=3.0,
        attention_multiplier=0.15, residual_multiplier=0.5, logits_scaling=2.5), seed=44),
]}


class Imported:
    """A case's transformers model, its saved directory and tfport's import of it (the fields
    tests/hf/test_decoders.py's helpers read)."""

    def __init__(self, case: HFCase, directory: Path):
        self.case, self.directory = case, directory
        self.hf = build_hf(case)
        save_hf(self.hf, directory, case)
        self.model = load_hf_model(directory)


def importer(make_directory):
    """``get(name)`` -> Imported, each case built once; ``make_directory(name)`` gives it a new
    directory."""
    cache: dict[str, Imported] = {}

    def get(name: str) -> Imported:
        if name not in cache:
            cache[name] = Imported(MOE_CASES[name], make_directory(name))
        return cache[name]

    return get
