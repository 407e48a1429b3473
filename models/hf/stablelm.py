"""StableLM (``model_type`` ``stablelm``) -> decoder.

LLaMA's tensor names with LayerNorm (with bias), SwiGLU, partial rotary (``partial_rotary_factor``,
rotate-half), q/k/v biases as ``use_qkv_bias`` says and none on the output. With
``use_parallel_residual`` the attention and the MLP both read ``input_layernorm``'s output (there
is no ``post_attention_layernorm``; tfport's ``ffn_norm`` gets a copy of it).
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, refuse, rope_fields, rope_parameters, token_ids
from .llama import LLAMA_LAYER, ROTARY_BUFFERS
from .rules import QKV, Architecture, Rule, decoder_lm, params


def _stablelm_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    if hf.get("qk_layernorm"):
        refuse(hf, "qk_layernorm", True, "its q/k norms are LayerNorms with one weight per head; "
               "tfport's qk_norm is one RMSNorm shared by the heads")
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=n_heads),
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=hf_field(hf, "num_hidden_layers"),
        norm="layernorm", norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_eps", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="silu")), gated_ffn=True,
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=4096),
        **rope_fields(hf, {"partial_rotary_factor": 0.25, **rope_parameters(hf)}, head_dim=d_model // n_heads),
        parallel_residual=bool(hf.get("use_parallel_residual", False)),
        attention_bias=bool(hf.get("use_qkv_bias", False)), attention_out_bias=False, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


def _rules(parallel: bool) -> tuple[Rule, ...]:
    ffn_norm = "input_layernorm" if parallel else "post_attention_layernorm"
    return decoder_lm(
        LLAMA_LAYER, "model.embed_tokens.weight", "model.norm", norms=("input_layernorm", ffn_norm),
        attn=[*params("decoder.layers.{i}.attn.qkv",
                      tuple(f"{LLAMA_LAYER}.self_attn.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{LLAMA_LAYER}.self_attn.o_proj")],
        ffn=[rule for p in ("gate", "up", "down")
             for rule in params(f"decoder.layers.{{i}}.ffn.{p}", f"{LLAMA_LAYER}.mlp.{p}_proj")])


def _parallel(config: ModelConfig) -> bool:
    return config.parallel_residual


STABLELM = Architecture(
    model_types=("stablelm",),
    classes=("StableLmForCausalLM", "StableLmModel"),
    base_prefix="model.",
    config=_stablelm_config,
    # The ffn_norm rules differ by residual kind; the first rule whose `when` holds applies.
    rules=tuple(Rule(r.target, r.sources, r.transform, _parallel) for r in _rules(True)
                if r.target.startswith("decoder.layers.{i}.ffn_norm")) + _rules(False),
    ignored=ROTARY_BUFFERS,
)
