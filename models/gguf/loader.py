"""Import a GGUF checkpoint: its metadata as a Hugging Face config dict (RoPE scaling from the
metadata and the rope tensors, windows and window patterns), its tensors under Hugging Face names
(dequantised to float32, the converter's permutations, regroupings and transposes undone), then
the strict Hugging Face importer, whose refusals are restated with the file's metadata keys.

    checkpoint = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    checkpoint.model            # tfport reference module (eval mode)
    checkpoint.tokenizer_json   # tokenizer.json text built from the GGUF vocabulary
    checkpoint.chat_template    # tokenizer.chat_template, or None
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .architectures import (LLAMA3_TENSOR, LONGROPE_TENSORS, ROPE_TENSORS, GGUFArchitecture,
                            architecture, unpermute_rows)
from .reader import GGUFFile, Shape, open_gguf, own_float32

log = logging.getLogger(__name__)

# tokenizer.ggml.<key> -> HF config field
TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
             "padding_token_id": "pad_token_id"}
ROPE_SCALING_NONE = ("none", None)


def _scalar(file: GGUFFile, key: str, value: Any) -> Any:
    if isinstance(value, list):  # e.g. a per-layer head count
        if len(set(value)) != 1:
            raise ValueError(f"{file.path.name}: {key}={value} differs between layers; tfport's "
                             "config holds one value for all layers")
        value = value[0]
    return value


def hf_config(file: GGUFFile, arch: GGUFArchitecture) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict that ``file``'s metadata describes."""
    md, prefix = file.metadata, arch.name + "."
    for suffix, why in arch.refused.items():
        if md.get(prefix + suffix):
            raise ValueError(f"{file.path.name}: {prefix}{suffix}={md[prefix + suffix]!r} is not "
                             f"supported: {why}")
    if md.get(prefix + "attention.causal", True) is not True:  # llama.cpp's flag of bidirectional embedders
        raise ValueError(f"{file.path.name}: {prefix}attention.causal={md[prefix + 'attention.causal']!r} is "
                         "not supported: tfport's decoders attend causally")
    config: dict[str, Any] = {"model_type": arch.model_type, "architectures": [arch.hf_class],
                              **arch.defaults}
    for suffix, name in arch.config.items():
        if prefix + suffix in md:
            config[name] = _scalar(file, prefix + suffix, md[prefix + suffix])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in md:
        config["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    rotary = md.get(prefix + "rope.dimension_count")
    if rotary is not None and heads and hidden:
        head_dim = config.get("head_dim", hidden // heads)
        if rotary != head_dim:  # the HF importer refuses partial rotary with the reason
            config["partial_rotary_factor"] = rotary / head_dim
    names = set(file.tensor_names())
    config.update(rope_scaling(file, arch, config))
    config.update(window_fields(file, arch, config))
    config["tie_word_embeddings"] = "output.weight" not in names
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    for key, name in TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in md:
            config[name] = md[f"tokenizer.ggml.{key}"]
    if arch.derived is not None:
        config.update(arch.derived(config, frozenset(names)))
    return config


def rope_scaling(file: GGUFFile, arch: GGUFArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields of the file's RoPE scaling (``{}`` without one), as llama.cpp's
    converter writes each kind:

    * LongRoPE (Phi-3.5, Phi-4-mini): the tensors rope_factors_long/short, rope.scaling.attn_factor
      and rope.scaling.original_context_length;
    * llama3 (Llama 3.1-3.3): only the tensor rope_freqs, the divisor of each frequency; the
      parameters it implies are recovered and checked against it (``llama3_parameters``);
    * linear and YaRN (Qwen2.5 long context): rope.scaling.type, .factor, .original_context_length,
      .yarn_beta_fast / _slow and .yarn_attn_factor (transformers' attention_factor).
    """
    md, prefix, names = file.metadata, arch.name + ".", set(file.tensor_names())
    kind_key = prefix + "rope.scaling.type"
    kind = md.get(kind_key)

    def required(suffix: str) -> Any:
        if prefix + suffix not in md:
            raise ValueError(f"{file.path.name}: {kind_key}={kind!r} needs {prefix}{suffix}, which "
                             "the file does not have")
        return md[prefix + suffix]

    if names & set(LONGROPE_TENSORS) or kind == "longrope":
        missing = [n for n in LONGROPE_TENSORS if n not in names]
        if missing:
            raise ValueError(f"{file.path.name}: LongRoPE needs the tensors {list(LONGROPE_TENSORS)}; "
                             f"the file lacks {missing}")
        kind = "longrope"
        original = int(required("rope.scaling.original_context_length"))
        long, short = (file.dequantize(n).tolist() for n in LONGROPE_TENSORS)
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": original,
                   "long_factor": long, "short_factor": short}
        if prefix + "rope.scaling.attn_factor" in md:
            scaling["attention_factor"] = float(md[prefix + "rope.scaling.attn_factor"])
        # transformers' Phi-3 reads the trained length from the top-level field
        return {"rope_scaling": scaling, "original_max_position_embeddings": original}
    if LLAMA3_TENSOR in names:
        if kind not in ROPE_SCALING_NONE:
            raise ValueError(f"{file.path.name}: {LLAMA3_TENSOR} (llama3 RoPE scaling) and "
                             f"{kind_key}={kind!r} together: expected one of them")
        head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
        rotary = int(md.get(prefix + "rope.dimension_count", head_dim))
        factors = file.dequantize(LLAMA3_TENSOR).astype(np.float64)
        params = llama3_parameters(factors, float(config.get("rope_theta", 10000.0)), rotary,
                                   f"{file.path.name}: {LLAMA3_TENSOR}")
        return {} if params is None else {"rope_scaling": params}
    if kind in ROPE_SCALING_NONE:
        return {}
    factor = float(required("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    if kind == "yarn":
        for suffix, neutral in (("rope.scaling.yarn_ext_factor", 1.0), ("rope.scaling.yarn_log_multiplier", 0.0)):
            value = md.get(prefix + suffix, neutral)
            if value != neutral:
                raise ValueError(f"{file.path.name}: {prefix}{suffix}={value!r} is not supported: "
                                 f"tfport's YaRN is transformers' (expected {neutral} or absent)")
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": int(required("rope.scaling.original_context_length"))}
        for suffix, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("yarn_attn_factor", "attention_factor")):
            if prefix + "rope.scaling." + suffix in md:
                scaling[name] = float(md[prefix + "rope.scaling." + suffix])
        return {"rope_scaling": scaling}
    raise ValueError(f"{file.path.name}: {kind_key}={kind!r} is not supported; tfport reads 'none', "
                     "'linear', 'yarn', 'longrope' and llama3's rope_freqs.weight")


# llama3 RoPE scaling: the converter's defaults, assumed where rope_freqs cannot tell them apart
# (fewer than two frequencies in the interpolated band).
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192
LLAMA3_RTOL = 1e-5  # rope_freqs is float32: the implied factors must agree to its precision


def rope_wavelengths(theta: float, rotary: int) -> np.ndarray:
    """2 pi / frequency of each rotated channel pair [rotary / 2], float64."""
    return 2 * np.pi * theta ** (np.arange(0, rotary, 2) / rotary)


def llama3_factors(theta: float, rotary: int, factor: float, low: float, high: float,
                   original: float) -> np.ndarray:
    """The divisor of each RoPE frequency [rotary / 2] that llama3 scaling implies, as llama.cpp's
    converter computes rope_freqs (and transformers its inverse frequencies)."""
    wavelength = rope_wavelengths(theta, rotary)
    smooth = (original / wavelength - low) / (high - low)
    band = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, band))


def llama3_parameters(factors: np.ndarray, theta: float, rotary: int, origin: str) -> dict[str, Any] | None:
    """The llama3 scaling parameters that produce ``factors`` (rope_freqs [rotary / 2]), or None
    when every factor is 1 (no scaling).

    The factors depend on ``original / low_freq_factor`` and ``original / high_freq_factor`` only,
    so low_freq_factor is taken as 1 (every Llama 3.x release's). The factor is the largest
    divisor; each frequency in the interpolated band gives one linear equation in ``original``
    and ``high_freq_factor``: solved by least squares from two or more, with the converter's
    default high_freq_factor 4 from one, and both defaults (8192 trained positions) from none.
    The parameters are then checked: the factors they imply must equal ``factors``.
    """
    if factors.shape != (rotary // 2,):
        raise ValueError(f"{origin}: shape {list(factors.shape)}, expected [{rotary // 2}] (one "
                         "divisor per rotary frequency)")
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=0, atol=LLAMA3_RTOL):
        return None
    wavelength = rope_wavelengths(theta, rotary)
    band = (factors > 1 + LLAMA3_RTOL) & (factors < factor * (1 - LLAMA3_RTOL))
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    high, original = LLAMA3_HIGH_FREQ_FACTOR, float(LLAMA3_ORIGINAL_CONTEXT)
    if band.sum() >= 2:  # original / w - smooth (high - 1) = 1 for each w in the band
        system = np.stack([1 / wavelength[band], -smooth], axis=1)
        (original, spread), *_ = np.linalg.lstsq(system, np.ones(band.sum()), rcond=None)
        high = round(1 + float(spread), 6)
    elif band.sum() == 1:
        original = float(wavelength[band][0] * (1 + smooth[0] * (high - 1)))
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": high, "original_max_position_embeddings": int(round(original))}
    implied = llama3_factors(theta, rotary, factor, 1.0, high, params["original_max_position_embeddings"])
    if not np.allclose(implied, factors, rtol=LLAMA3_RTOL, atol=0):
        raise ValueError(f"{origin}: the divisors {np.round(factors, 5).tolist()} are not llama3 "
                         f"RoPE scaling's: the closest parameters ({params}) imply "
                         f"{np.round(implied, 5).tolist()}")
    return params


def window_fields(file: GGUFFile, arch: GGUFArchitecture, config: dict[str, Any]) -> dict[str, Any]:
    """The window's HF fields: attention.sliding_window 0 means none (Phi-4-mini's files say
    so); attention.sliding_window_pattern, a period n (layer i slides unless (i + 1) % n == 0, as
    llama.cpp's set_swa_pattern) or one flag per layer (true: sliding), becomes ``layer_types``."""
    if not config.get("sliding_window"):
        return {"sliding_window": None} if "sliding_window" in config else {}
    key = arch.name + ".attention.sliding_window_pattern"
    pattern = file.metadata.get(key)
    if pattern is None:
        return {}
    layers = int(config["num_hidden_layers"]) if "num_hidden_layers" in config else None
    if isinstance(pattern, list):
        if layers is not None and len(pattern) != layers:
            raise ValueError(f"{file.path.name}: {key} has {len(pattern)} entries, expected one per "
                             f"layer ({layers})")
        sliding = [bool(flag) for flag in pattern]
    elif isinstance(pattern, int) and pattern >= 0 and layers is not None:
        sliding = [pattern == 0 or (i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise ValueError(f"{file.path.name}: {key}={pattern!r}: expected a layer period or one "
                         "flag per layer")
    return {"layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


# HF config fields the loader fills from other metadata keys or tensors than arch.config says
# ({arch}: the architecture's prefix), for the refusals of the Hugging Face importer.
HF_FIELD_SOURCES = {
    "rope_parameters": "{arch}.rope.scaling.* (or the tensors rope_freqs / rope_factors_long / short)",
    "rope_type": "{arch}.rope.scaling.type", "partial_rotary_factor": "{arch}.rope.dimension_count",
    "layer_types": "{arch}.attention.sliding_window_pattern",
    "attn_config.alibi": "{arch}.attention.max_alibi_bias",
    "attn_config.alibi_bias_max": "{arch}.attention.max_alibi_bias",
    "attn_config.clip_qkv": "{arch}.attention.clamp_kqv",
}
_HF_REFUSAL = re.compile(r"config\.json: (?:no )?'?(?P<field>[A-Za-z_][\w.]*)")


def gguf_error(err: ValueError, file: GGUFFile, arch: GGUFArchitecture) -> ValueError:
    """A refusal of the Hugging Face importer, which speaks of config.json fields, restated for
    the GGUF file: its name and the metadata key the field was read from."""
    message = str(err)
    match = _HF_REFUSAL.match(message)
    if match is None:
        return err
    sources = {hf: f"{arch.name}.{suffix}" for suffix, hf in arch.config.items()}
    sources.update({hf: key.format(arch=arch.name) for hf, key in HF_FIELD_SOURCES.items()})
    detail = message.removeprefix("config.json: ")
    key = sources.get(match["field"])
    if key is None:
        return ValueError(f"{file.path.name}: the Hugging Face config its metadata makes: {detail}")
    return ValueError(f"{file.path.name}: metadata {key} (as the Hugging Face config field "
                      f"{match['field']}): {detail}")


def expert_blocks(file: GGUFFile, name: str, expert: int) -> np.ndarray:
    """Expert ``expert``'s stored bytes in the stack ``name`` [N, rows, cols]: uint8 [rows, bytes
    per row] (each expert's rows are contiguous in the file)."""
    return file.blocks(name)[expert].reshape(file.shape(name)[1], -1)


def dequantize_expert(file: GGUFFile, name: str, expert: int) -> np.ndarray:
    """Expert ``expert``'s slice of the stack ``name`` as float32 [rows, cols], dequantised alone
    (a Mixtral stack is ~2 GB of float32 per layer and projection)."""
    import gguf

    values = gguf.quants.dequantize(expert_blocks(file, name, expert),
                                    gguf.GGMLQuantizationType[file.tensor_type(name)])
    values = own_float32(values).reshape(file.shape(name)[1:])
    file.release(name)
    file.notify(name)
    return values


class GGUFTensors:
    """The tensors of a GGUF file under Hugging Face names, as the HF importer reads them:
    ``keys()``, ``in``, ``shape(name)``, ``get(name)`` (float32 torch tensor), ``where(name)``.
    A stack of experts [N, out, in] is N HF tensors [out, in], one per expert."""

    def __init__(self, file: GGUFFile, arch: GGUFArchitecture, config: dict[str, Any]):
        self.file = file
        self.arch = arch
        self.config = config
        # HF name -> (GGUF name, the GGUF prefix it matched, heads to un-permute over or None,
        # the expert's index in a stack or None)
        self._source: dict[str, tuple[str, str, int | None, int | None]] = {}
        names = frozenset(file.tensor_names())
        unmapped = []
        for name in file.tensor_names():
            if name in ROPE_TENSORS:  # RoPE settings, read into the config by hf_config
                continue
            mapped = arch.hf_name(name, names)
            if mapped is None:
                unmapped.append(f"{name} {list(file.shape(name))}")
                continue
            hf_name, prefix = mapped
            heads_field, heads = arch.permuted.get(prefix), None
            if heads_field is not None:
                if heads_field not in config:
                    raise ValueError(f"{file.path.name}: {name} needs {heads_field} to un-permute "
                                     "its rows, and the metadata does not give it")
                heads = int(config[heads_field])
            if "{e}" in hf_name:  # a stack of experts [N, out, in]
                for expert in range(file.shape(name)[0]):
                    self._source[hf_name.format(e=expert)] = (name, prefix, heads, expert)
            else:
                self._source[hf_name] = (name, prefix, heads, None)
        if unmapped:
            raise ValueError(f"{file.path.name}: tensor(s) {unmapped[:12]} have no counterpart in "
                             f"tfport's {arch.name!r} mapping (known: {sorted(arch.tensor_map(names))})")

    def keys(self) -> frozenset[str]:
        return frozenset(self._source)

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def where(self, name: str) -> str:
        gguf_name, _, _, expert = self._source[name]
        part = "" if expert is None else f"[{expert}]"
        return f"{self.file.path.name}: {gguf_name}{part} ({self.file.tensor_type(gguf_name)})"

    def shape(self, name: str) -> Shape:
        gguf_name, prefix, _, expert = self._source[name]
        shape = self.file.shape(gguf_name)
        if expert is not None:
            shape = shape[1:]
        if prefix in self.arch.row_vectors and len(shape) == 1:
            shape = (1, *shape)
        return shape[::-1] if prefix in self.arch.transposed else shape

    def get(self, name: str) -> torch.Tensor:
        """The HF tensor ``name``, float32: dequantised, then the converter's arithmetic undone
        (Q/K row permutation, regrouped rows, transpose, added constant)."""
        gguf_name, prefix, heads, expert = self._source[name]
        if expert is None:
            values = self.file.dequantize(gguf_name)
        else:
            values = dequantize_expert(self.file, gguf_name, expert)
        if prefix in self.arch.row_vectors and values.ndim == 1:  # stored as [E]: the HF [1, E]
            values = values.reshape(1, -1)
        if heads is not None:
            values = unpermute_rows(values, heads)
        if prefix in self.arch.reshaped:
            values = self.arch.reshaped[prefix](values, self.config)
        if prefix in self.arch.transposed:
            values = np.ascontiguousarray(values.T)
        if prefix in self.arch.added:
            values = values - np.float32(self.arch.added[prefix])
        return torch.from_numpy(values)


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, imported: the module, tokenizer.json text, chat template."""

    model: nn.Module
    tokenizer_json: str | None
    chat_template: str | None
    hf_config: dict[str, Any]


def read_gguf(path: str | os.PathLike) -> tuple[GGUFFile, GGUFArchitecture, dict[str, Any], GGUFTensors]:
    """Open ``path`` and check it: architecture, tensor types, names -> (file, entry, HF config,
    tensor source)."""
    file = open_gguf(path)
    arch = architecture(file.architecture, file.path.name)
    file.check_types()
    config = hf_config(file, arch)
    return file, arch, config, GGUFTensors(file, arch, config)


def load_gguf(path: str | os.PathLike, tokenizer: bool = True, lazy: bool = False) -> GGUFCheckpoint:
    """Import the GGUF checkpoint at ``path`` (see the module doc). Raises ``ValueError`` naming
    the architecture, tensor type or tensor that tfport cannot import. With ``lazy``, each weight
    is dequantised from the memory-mapped file when it is read (``tfport.models.lazy``)."""
    from tfport.models.hf import load_from_tensors

    file, arch, config, tensors = read_gguf(path)
    try:
        model = load_from_tensors(config, tensors, str(file.path), lazy)
    except ValueError as err:
        raise gguf_error(err, file, arch) from None
    text = None
    if tokenizer and "tokenizer.ggml.model" in file.metadata:
        from .tokenizer import tokenizer_json
        text = tokenizer_json(file.metadata, file.path.name)
    log.info("imported GGUF %s (%s, %d tensors)", file.path.name, arch.name, len(tensors.keys()))
    return GGUFCheckpoint(model, text, file.metadata.get("tokenizer.chat_template"), config)
