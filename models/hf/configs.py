"""Reading a Hugging Face ``config.json``: the helpers every family's config function shares.

HF renamed several fields over the years (``hidden_size`` / ``n_embd``), spells activations its own
way and stores RoPE settings in two layouts (``rope_parameters``; ``rope_scaling`` + ``rope_theta``); these read them the same way for every family and
refuse, naming the field and the value, what tfport cannot compute exactly.
"""

from __future__ import annotations

import logging
import math

from tfport.config.checks import is_int
from tfport.config.rope import RopeConfig
from tfport.config.window import WindowConfig
from tfport.files import read_json_object

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


read_json = read_json_object  # config.json, tokenizer_config.json ...: a JSON object or a ValueError naming the file


def hf_field(hf: dict, *names: str, default=None):
    """The first of ``names`` set in ``hf`` (HF renamed several fields over the years), else
    ``default``; required when there is no default."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is None:
        raise ValueError(f"config.json: no {' / '.join(repr(n) for n in names)}; expected the "
                         f"{hf.get('model_type', 'model')} architecture's size fields")
    return default


def refuse(hf: dict, what: str, value, why: str) -> None:
    raise ValueError(f"config.json: {what}={value!r} is not supported for model_type="
                     f"{hf.get('model_type')!r}: {why}")


# HF activation names -> tfport's; "gelu_new", "gelu_fast" and "gelu_pytorch_tanh" are all
# 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written differently.
HF_ACTIVATIONS = {
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu",
}


def hf_activation(hf: dict, name: str) -> str:
    if name not in HF_ACTIVATIONS:
        refuse(hf, "activation", name, f"tfport computes {sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


def token_ids(hf: dict, vocab_size: int) -> dict:
    """bos/eos/pad ids as tfport holds them: one int each, inside the vocabulary.

    A list of eos ids keeps its first (tfport's config holds one); an id outside the vocabulary
    is dropped with a warning. A missing pad id becomes eos (or 0): padded slots are masked, so the
    id only has to be a valid row of the embedding.
    """
    ids = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(name)
        if isinstance(value, list):
            if len(value) > 1:
                log.warning("config.json: %s=%s; tfport keeps the first", name, value)
            value = value[0] if value else None
        if value is not None and not (isinstance(value, int) and 0 <= value < vocab_size):
            log.warning("config.json: %s=%r is outside the vocabulary [0, %d); dropped",
                        name, value, vocab_size)
            value = None
        ids[name] = value
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"] if ids["eos_token_id"] is not None else 0
    return ids


def rope_parameters(hf: dict) -> dict:
    """The RoPE parameters as one dict: transformers 5's ``rope_parameters``, or the
    ``rope_scaling`` object with the top-level ``rope_theta`` / ``partial_rotary_factor`` that
    earlier checkpoints (Llama 3.1/3.2, Qwen2, Phi-3) ship."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        refuse(hf, "rope_parameters", params, "expected a JSON object")
    params = dict(params)
    for name in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if name not in params and hf.get(name) is not None:
            params[name] = hf[name]
    return params


def rope_fields(hf: dict, params: dict | None = None, default_theta: float = 10000.0,
                head_dim: int | None = None) -> dict:
    """``ModelConfig``'s ``rope`` from the RoPE parameters (``rope_parameters(hf)`` unless given:
    per-layer-type models pass one entry), as keyword arguments: ``{"rope": RopeConfig(...)}``."""
    return {"rope": RopeConfig(**_rope_settings(hf, params, default_theta, head_dim))}


def _rope_settings(hf: dict, params: dict | None, default_theta: float, head_dim: int | None) -> dict:
    """``RopeConfig``'s fields from the RoPE parameters.

    Computed exactly: the default, linear (position interpolation) and llama3 (frequency bands)
    types. Refused, naming the type: the others (dynamic NTK depends on the running length,
    yarn and longrope rescale cos/sin too), which have no config option yet.
    """
    params = rope_parameters(hf) if params is None else params
    if set(params) & {"full_attention", "sliding_attention"}:
        refuse(hf, "rope_parameters", params, "per-layer-type RoPE is read by the families that "
               "have it (Gemma 3), not by this one")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", 1.0)
    fields = {"theta": theta}
    if partial != 1.0:
        rotary = int(head_dim * partial) if head_dim is not None else None  # as transformers rounds it
        if rotary is None or rotary % 2 or rotary <= 0:
            refuse(hf, "partial_rotary_factor", partial, "tfport rotates an even number of channels "
                   "of each head" + ("" if head_dim else " (this family rotates whole heads)"))
        fields["rotary_dim"] = rotary
    if kind == "default":
        return fields
    if kind == "linear":
        return {**fields, "scaling": "linear", "scaling_factor": float(params["factor"])}
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if params.get(k) is None]
        if missing:
            refuse(hf, "rope_parameters", params, f"rope_type 'llama3' needs {missing}")
        return {**fields, "scaling": "llama3", "scaling_factor": float(params["factor"]),
                "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]),
                "original_max_positions": int(params["original_max_position_embeddings"])}
    if kind == "longrope":
        original = params.get("original_max_position_embeddings")
        if original is None or params.get("short_factor") is None or params.get("long_factor") is None:
            refuse(hf, "rope_parameters", params, "rope_type 'longrope' needs short_factor, long_factor "
                   "and original_max_position_embeddings")
        factor = params.get("factor") or hf_field(hf, "max_position_embeddings") / original
        attention = params.get("attention_factor")
        if attention is None:  # transformers' default
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return {**fields, "scaling": "longrope", "original_max_positions": int(original),
                "short_factor": tuple(float(f) for f in params["short_factor"]),
                "long_factor": tuple(float(f) for f in params["long_factor"]),
                "attention_factor": float(attention)}
    if kind == "yarn":
        original = params.get("original_max_position_embeddings")
        if original is None:
            refuse(hf, "rope_parameters", params, "rope_type 'yarn' needs original_max_position_embeddings")
        factor = params.get("factor") or hf_field(hf, "max_position_embeddings") / original
        attention = params.get("attention_factor")
        if attention is None:  # transformers' default (mscale)

            def mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        return {**fields, "scaling": "yarn", "scaling_factor": float(factor),
                "original_max_positions": int(original), "attention_factor": float(attention),
                "beta_fast": float(params.get("beta_fast") or 32.0),
                "beta_slow": float(params.get("beta_slow") or 1.0),
                "truncate": bool(params.get("truncate", True))}
    if kind == "dynamic":  # transformers: plain RoPE up to max_position_embeddings, NTK past it
        context = hf_field(hf, "max_position_embeddings")
        factor = float(params["factor"])
        return {**fields, "scaling": "dynamic", "scaling_factor": factor,
                "original_max_positions": int(context)}
    refuse(hf, "rope_type", kind, "tfport maps 'default', 'linear', 'llama3', 'longrope', 'yarn' and "
           "'dynamic' exactly")


def sliding_fields(hf: dict, n_layers: int, all_layers: bool) -> dict:
    """``ModelConfig``'s ``window`` from ``sliding_window`` and ``layer_types``, as keyword
    arguments: ``{"window": WindowConfig(...)}``, or none without a window.

    ``layer_types`` (transformers 5) names each layer ``sliding_attention`` or
    ``full_attention``; without it every layer slides when ``all_layers`` (Mistral, Phi-3) and
    none otherwise. ``use_sliding_window: false`` (Qwen2) turns the window off.
    """
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return {}
    if not is_int(window) or window <= 0:
        refuse(hf, "sliding_window", window, "expected a positive integer or null")
    types = hf.get("layer_types")
    if types is None:
        local = tuple(range(n_layers)) if all_layers else ()
    else:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != n_layers:
            refuse(hf, "layer_types", types, f"expected {n_layers} entries of 'sliding_attention' / "
                   "'full_attention'")
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not local:
        return {}
    return {"window": WindowConfig(window, None if len(local) == n_layers else local)}


def refuse_non_bert_encoder(hf: dict, name: str) -> None:
    """Refuse what the BERT-like importers (BERT, RoBERTa) cannot map: relative position
    embeddings, and a causal or cross-attending stack; ``name`` is the family, for the message."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        refuse(hf, "position_embedding_type", hf["position_embedding_type"],
               "tfport maps absolute (learned) positions only")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        refuse(hf, "is_decoder", True, f"a causal or cross-attending {name} is not tfport's encoder")
