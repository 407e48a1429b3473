"""Reading a Hugging Face ``config.json``: the helpers every family's config function shares.

HF renamed several fields over the years (``hidden_size`` / ``n_embd``), spells activations its own
way and stores RoPE settings in two layouts; these read them the same way for every family and
refuse, naming the field and the value, what tfport cannot compute exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


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


def rope_fields(hf: dict) -> dict:
    """RoPE fields from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``.

    Only the default and linear (position interpolation) types are computed exactly as tfport
    does; dynamic NTK depends on the running length and yarn/longrope/llama3 rescale frequency
    bands, which tfport's config cannot express.
    """
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        refuse(hf, "rope_parameters", params, "expected a JSON object")
    if set(params) & {"full_attention", "sliding_attention"}:
        refuse(hf, "rope_parameters", params, "per-layer-type RoPE is not expressible in tfport")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse(hf, "partial_rotary_factor", partial, "tfport rotates the whole head dimension")
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind == "linear":
        return {"rope_theta": float(theta), "rope_scaling": "linear",
                "rope_scaling_factor": float(params["factor"])}
    refuse(hf, "rope_type", kind, "tfport maps 'default' and 'linear' exactly; other types "
           "(dynamic, yarn, longrope, llama3, ...) need a config option tfport does not have")
