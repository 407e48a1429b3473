"""Phi-1 / Phi-1.5 / Phi-2 (``model_type`` ``phi``) -> decoder.

One LayerNorm (``input_layernorm``) feeds attention and MLP in parallel, ``x + attn(ln(x)) +
mlp(ln(x))`` (tfport's ``ffn_norm`` gets a copy of it); partial rotary (``partial_rotary_factor``,
0.5 when absent as in transformers; Phi-2's is 0.4), rotate-half; biases on q/k/v, the output
projection (``dense``), the MLP (``fc1`` / ``fc2``, ``gelu_new``) and the LM head; a final
LayerNorm (``final_layernorm``).

GGUF files converted from Phi-2's original layout (``mixer.Wqkv``, before transformers had
``PhiForCausalLM``) hold q, k and v as one fused ``attn_qkv`` ([q | k | v] rows); the GGUF
importer presents it as ``self_attn.qkv_proj``, taken as it is where present.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, refuse, rope_fields, rope_parameters, token_ids
from .llama import ROTARY_BUFFERS
from .rules import QKV, Architecture, Rule, decoder_lm, params

PHI_LAYER = "model.layers.{i}"


def _phi_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    if hf.get("qk_layernorm"):
        refuse(hf, "qk_layernorm", True, "its q/k norms are LayerNorms with a bias; tfport's qk_norm "
               "is a per-head RMSNorm")
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    head_dim = hf_field(hf, "head_dim", default=d_model // n_heads)
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=n_heads),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=hf_field(hf, "num_hidden_layers"),
        norm="layernorm", norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_eps", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="gelu_new")),
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=2048),
        **rope_fields(hf, {"partial_rotary_factor": 0.5, **rope_parameters(hf)}, head_dim=head_dim),
        parallel_residual=True, attention_bias=True, mlp_bias=True, lm_head_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


_FUSED = f"{PHI_LAYER}.self_attn.qkv_proj"

PHI = Architecture(
    model_types=("phi",),
    classes=("PhiForCausalLM", "PhiModel"),
    base_prefix="model.",
    config=_phi_config,
    # The first rule for a target that applies wins: the fused qkv where the tensors hold it.
    rules=(*(Rule(r.target, r.sources, r.transform, if_present=True)
             for r in params("decoder.layers.{i}.attn.qkv", _FUSED)),
           *decoder_lm(
               PHI_LAYER, "model.embed_tokens.weight", "model.final_layernorm",
               norms=("input_layernorm", "input_layernorm"),
               attn=[*params("decoder.layers.{i}.attn.qkv",
                             tuple(f"{PHI_LAYER}.self_attn.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
                     *params("decoder.layers.{i}.attn.out", f"{PHI_LAYER}.self_attn.dense")],
               ffn=[*params("decoder.layers.{i}.ffn.up", f"{PHI_LAYER}.mlp.fc1"),
                    *params("decoder.layers.{i}.ffn.down", f"{PHI_LAYER}.mlp.fc2")],
               extra=[Rule("lm_head.bias", ("lm_head.bias",))])),
    ignored=ROTARY_BUFFERS,
)
