"""Import Hugging Face checkpoints (``config.json`` + ``*.safetensors``) into the reference modules.

Reads the directory directly -- JSON and safetensors, never ``transformers``, never unpickled -- and
maps every tensor onto a tfport module:

* ``llama``, ``mistral`` -> decoder: pre-norm RMSNorm, SwiGLU, RoPE (default, or linear scaling),
  GQA. ``q/k/v_proj`` are stacked into the fused ``qkv`` rows [q | k | v]; ``gate/up/down_proj``
  -> ``ffn.gate/up/down``; ``lm_head`` tied or not.
* ``gpt2`` -> decoder: pre-norm LayerNorm, learned positions, GELU (tanh form for ``gelu_new``),
  tied head. Conv1D weights are [in, out] and get transposed; ``c_attn``'s outputs are already
  [q | k | v].
* ``bert`` -> encoder: post-norm LayerNorm, learned positions, token types, embedding LayerNorm;
  the pooler and the MLM head (``cls.predictions.*``, decoder tied to the word embeddings) when
  the file has them. ``query/key/value`` are stacked into ``qkv``.
* ``bloom`` -> decoder: ALiBi, LayerNorm after the word embeddings, tanh GELU, tied head.
  ``query_key_value`` rows are per head [H, 3, D] and are regrouped into [3, H, D] = [q | k | v].
* ``mpt`` -> decoder: ALiBi (power-of-two head counts), exact GELU, no biases (its LayerNorms'
  zero biases are filled in); ``Wqkv`` is already [q | k | v].
* ``t5`` -> encoder-decoder: pre-norm RMSNorm, relative attention bias (one table per stack, from
  block 0), unscaled attention, ReLU or gated FFN (``wi`` or ``wi_0``/``wi_1``), head tied to
  ``shared`` (scaled by d_model^-0.5 when the config ties, as v1.0) or the file's own ``lm_head``.

Each family is one ``Architecture`` entry in ``ARCHITECTURES``: a config function (HF config dict
-> ``ModelConfig``, refusing what tfport cannot express exactly) and a table of ``Rule`` s, one per
tfport tensor name (``{i}`` stands for the layer index), saying which HF tensors it is made of and
how (``Transform``); a rule may apply only to some configs (``when``). Adding a family is one
more entry. Loading is strict: every tfport tensor must
be found with the expected shape, and every HF tensor must be used, listed as a tied copy, or
listed in ``ignored`` with the reason it is unused.

Weights are loaded as float32 whatever their stored dtype; ``tfport export --dtype`` picks the
exported precision.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tfport.config import ModelConfig

from . import build_model
from .checkpoint import _aliases

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_LISTED = 12  # problems listed per kind in one error message


# ------------------------------------------------------------------------------------ detection
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` is a Hugging Face one.

    HF configs name a ``model_type`` or ``architectures``; tfport's own checkpoints (also
    ``config.json`` + ``model.safetensors``) have a ``family`` instead. The weights are not looked
    at here: ``load_hf_model`` says what is wrong with them.
    """
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = _read_json(config)
    except ValueError:
        return False
    return "family" not in data and ("model_type" in data or "architectures" in data)


# ------------------------------------------------------------------------- config translation
def _field(hf: dict, *names: str, default=None):
    """The first of ``names`` set in ``hf`` (HF renamed several fields over the years), else
    ``default``; required when there is no default."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is None:
        raise ValueError(f"config.json: no {' / '.join(repr(n) for n in names)}; expected the "
                         f"{hf.get('model_type', 'model')} architecture's size fields")
    return default


def _refuse(hf: dict, what: str, value, why: str) -> None:
    raise ValueError(f"config.json: {what}={value!r} is not supported for model_type="
                     f"{hf.get('model_type')!r}: {why}")


# HF activation names -> tfport's; "gelu_new", "gelu_fast" and "gelu_pytorch_tanh" are all
# 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written differently.
HF_ACTIVATIONS = {
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu",
}


def _activation(hf: dict, name: str) -> str:
    if name not in HF_ACTIVATIONS:
        _refuse(hf, "activation", name, f"tfport computes {sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


def _token_ids(hf: dict, vocab_size: int) -> dict:
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


def _rope(hf: dict) -> dict:
    """RoPE fields from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``.

    Only the default and linear (position interpolation) types are computed exactly as tfport
    does; dynamic NTK depends on the running length and yarn/longrope/llama3 rescale frequency
    bands, which tfport's config cannot express.
    """
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        _refuse(hf, "rope_parameters", params, "expected a JSON object")
    if set(params) & {"full_attention", "sliding_attention"}:
        _refuse(hf, "rope_parameters", params, "per-layer-type RoPE is not expressible in tfport")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse(hf, "partial_rotary_factor", partial, "tfport rotates the whole head dimension")
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind == "linear":
        return {"rope_theta": float(theta), "rope_scaling": "linear",
                "rope_scaling_factor": float(params["factor"])}
    _refuse(hf, "rope_type", kind, "tfport maps 'default' and 'linear' exactly; other types "
            "(dynamic, yarn, longrope, llama3, ...) need a config option tfport does not have")


def _llama_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """LLaMA and Mistral: pre-norm RMSNorm, SwiGLU, RoPE, GQA."""
    d_model = _field(hf, "hidden_size")
    n_heads = _field(hf, "num_attention_heads")
    head_dim = _field(hf, "head_dim", default=d_model // n_heads)
    max_positions = _field(hf, "max_position_embeddings", default=2048)
    window = hf.get("sliding_window")
    if window is not None and window < max_positions:
        # Within `window` tokens sliding-window attention is plain causal attention; tfport has no
        # sliding-window mask, so the model is exact only up to there.
        log.warning("config.json: sliding_window=%d < max_position_embeddings=%d; tfport has no "
                    "sliding-window attention, max_positions is capped at %d", window,
                    max_positions, window)
        max_positions = window
    vocab_size = _field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=_field(hf, "num_key_value_heads", default=n_heads),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=_field(hf, "intermediate_size"), n_decoder_layers=_field(hf, "num_hidden_layers"),
        norm="rmsnorm", norm_position="pre", norm_eps=float(_field(hf, "rms_norm_eps", default=1e-6)),
        activation=_activation(hf, _field(hf, "hidden_act", default="silu")), gated_ffn=True,
        position="rope", max_positions=max_positions, **_rope(hf),
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **_token_ids(hf, vocab_size))


def _gpt2_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """GPT-2: pre-norm LayerNorm, learned positions, GELU (tanh form by default), tied head."""
    if hf.get("scale_attn_by_inverse_layer_idx"):
        _refuse(hf, "scale_attn_by_inverse_layer_idx", True,
                "a per-layer attention scale is not expressible in tfport's config")
    if hf.get("add_cross_attention"):
        _refuse(hf, "add_cross_attention", True, "tfport's decoder family has no cross-attention")
    d_model = _field(hf, "n_embd", "hidden_size")
    vocab_size = _field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model,
        n_heads=_field(hf, "n_head", "num_attention_heads"),
        d_ff=_field(hf, "n_inner", default=4 * d_model),
        n_decoder_layers=_field(hf, "n_layer", "num_hidden_layers"),
        norm="layernorm", norm_position="pre",
        norm_eps=float(_field(hf, "layer_norm_epsilon", default=1e-5)),
        activation=_activation(hf, _field(hf, "activation_function", default="gelu_new")),
        position="learned", max_positions=_field(hf, "n_positions", "n_ctx", default=1024),
        attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **_token_ids(hf, vocab_size))


BERT_POOLER_KEY = "bert.pooler.dense.weight"
BERT_MLM_KEY = "cls.predictions.transform.dense.weight"
# Which heads each BERT class has, when the checkpoint's keys are not at hand.
BERT_HEADS = {"BertModel": (True, False), "BertForMaskedLM": (False, True),
              "BertForPreTraining": (True, True)}


def _bert_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """BERT: post-norm LayerNorm, learned positions, token types; pooler and MLM head if present."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        _refuse(hf, "position_embedding_type", hf["position_embedding_type"],
                "tfport maps absolute (learned) positions only")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        _refuse(hf, "is_decoder", True, "a causal or cross-attending BERT is not tfport's encoder")
    if keys is not None:  # the heads the file holds (a BertModel may be saved without its pooler)
        pooler, mlm = BERT_POOLER_KEY in keys, BERT_MLM_KEY in keys
    else:
        pooler, mlm = BERT_HEADS[(hf.get("architectures") or ["BertModel"])[0]]
    vocab_size = _field(hf, "vocab_size")
    return ModelConfig(
        family="encoder", vocab_size=vocab_size, d_model=_field(hf, "hidden_size"),
        n_heads=_field(hf, "num_attention_heads"), d_ff=_field(hf, "intermediate_size"),
        n_encoder_layers=_field(hf, "num_hidden_layers"), norm="layernorm", norm_position="post",
        norm_eps=float(_field(hf, "layer_norm_eps", default=1e-12)),
        activation=_activation(hf, _field(hf, "hidden_act", default="gelu")),
        position="learned", max_positions=_field(hf, "max_position_embeddings", default=512),
        embedding_norm=True, type_vocab_size=_field(hf, "type_vocab_size", default=2),
        pooler=pooler, mlm_head=mlm, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **_token_ids(hf, vocab_size))


def _bloom_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """BLOOM: pre-norm LayerNorm, ALiBi, LayerNorm after the word embeddings, tanh GELU."""
    if hf.get("apply_residual_connection_post_layernorm"):
        _refuse(hf, "apply_residual_connection_post_layernorm", True,
                "residuals taken after the norm are not expressible in tfport's Block")
    d_model = _field(hf, "hidden_size", "n_embed")
    vocab_size = _field(hf, "vocab_size")
    # BLOOM's config has no length (ALiBi has no table); 2048 is what BLOOM was trained on.
    max_positions = _field(hf, "seq_length", "max_position_embeddings", default=2048)
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model,
        n_heads=_field(hf, "n_head", "num_attention_heads"), d_ff=4 * d_model,
        n_decoder_layers=_field(hf, "n_layer", "num_hidden_layers"), norm="layernorm",
        norm_position="pre", norm_eps=float(_field(hf, "layer_norm_epsilon", default=1e-5)),
        activation="gelu_tanh", position="alibi", max_positions=max_positions,
        embedding_norm=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **_token_ids(hf, vocab_size))


def _mpt_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """MPT: pre-norm LayerNorm without bias, ALiBi, exact GELU, no biases."""
    attn = hf.get("attn_config") or {}
    n_heads = _field(hf, "n_heads")
    if isinstance(n_heads, int) and n_heads > 0 and n_heads & (n_heads - 1):
        _refuse(hf, "n_heads", n_heads, "MPT orders its ALiBi slopes differently from the Press "
                "et al. scheme tfport (and BLOOM) use when the head count is not a power of two")
    checks = [  # (field, value, the value tfport computes, why)
        ("attn_config.alibi", attn.get("alibi", True), True, "tfport maps MPT with ALiBi only"),
        ("attn_config.alibi_bias_max", attn.get("alibi_bias_max", 8), 8,
         "tfport's ALiBi slopes are 2^(-8 i / H)"),
        ("attn_config.attn_type", attn.get("attn_type", "multihead_attention"), "multihead_attention",
         "transformers' MPT (the reference) has multi-head attention only"),
        ("attn_config.clip_qkv", attn.get("clip_qkv"), None, "tfport does not clamp q/k/v"),
        ("attn_config.qk_ln", attn.get("qk_ln", False), False, "tfport has no q/k LayerNorm"),
        ("attn_config.prefix_lm", attn.get("prefix_lm", False), False,
         "a prefix-LM mask is not expressible in tfport"),
        ("no_bias", hf.get("no_bias", True), True, "transformers' MPT (the reference) has no biases"),
        ("logit_scale", hf.get("logit_scale"), None, "transformers' MPT (the reference) ignores it"),
    ]
    for name, value, expected, why in checks:
        if value != expected:
            _refuse(hf, name, value, why)
    d_model = _field(hf, "d_model")
    vocab_size = _field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        d_ff=int(_field(hf, "expansion_ratio", default=4) * d_model),
        n_decoder_layers=_field(hf, "n_layers"), norm="layernorm", norm_position="pre",
        norm_eps=float(_field(hf, "layer_norm_epsilon", default=1e-5)), activation="gelu",
        position="alibi", max_positions=_field(hf, "max_seq_len", default=2048),
        attention_bias=False, mlp_bias=False, attention_scale=attn.get("softmax_scale"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **_token_ids(hf, vocab_size))


def _t5_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """T5 (v1.0 and v1.1): pre-norm RMSNorm, relative attention bias, unscaled attention.

    ``feed_forward_proj`` is ``ACT`` or ``gated-ACT`` ("gated-gelu" is the tanh GELU). The head is
    tied to ``shared`` unless the file holds its own ``lm_head.weight``; the decoder output is
    scaled by d_model^-0.5 before the head when the config ties embeddings (T5 v1.0), as
    transformers does (``scale_decoder_outputs``).
    """
    proj = _field(hf, "feed_forward_proj", default="relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        _refuse(hf, "feed_forward_proj", proj, "expected 'ACT' or 'gated-ACT'")
    gated = len(parts) == 2
    activation = "gelu_new" if proj == "gated-gelu" else parts[-1]
    d_model, n_heads, d_kv = _field(hf, "d_model"), _field(hf, "num_heads"), _field(hf, "d_kv")
    vocab_size = _field(hf, "vocab_size")
    n_layers = _field(hf, "num_layers")
    scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    tied = keys is None or "lm_head.weight" not in keys
    ids = _token_ids(hf, vocab_size)
    start = hf.get("decoder_start_token_id", ids["pad_token_id"])
    return ModelConfig(
        family="encoder-decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        head_dim=None if n_heads * d_kv == d_model else d_kv, d_ff=_field(hf, "d_ff"),
        n_encoder_layers=n_layers, n_decoder_layers=_field(hf, "num_decoder_layers", default=n_layers),
        norm="rmsnorm", norm_position="pre", norm_eps=float(_field(hf, "layer_norm_epsilon", default=1e-6)),
        activation=_activation(hf, activation), gated_ffn=gated, position="relative",
        relative_buckets=_field(hf, "relative_attention_num_buckets", default=32),
        relative_max_distance=_field(hf, "relative_attention_max_distance", default=128),
        # T5 has no position table; relative distances are bucketed up to max_distance, and
        # longer inputs still work -- n_positions (512) is what it was trained on.
        max_positions=_field(hf, "n_positions", default=512), attention_bias=False, mlp_bias=False,
        attention_scale=1.0, tie_embeddings=tied, lm_head_scale=d_model**-0.5 if scaled else 1.0,
        decoder_start_token_id=start, **ids)


# ---------------------------------------------------------------------------- tensor transforms
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Transform:
    """How HF tensors become one tfport tensor.

    ``shapes(target_shape, config)`` are the HF shapes it expects (checked before reading);
    ``apply(tensors, target_shape, config)`` builds the tfport tensor.
    """

    name: str
    shapes: Callable[[Shape, ModelConfig], list[Shape]]
    apply: Callable[[list[torch.Tensor], Shape, ModelConfig], torch.Tensor]


COPY = Transform("copy", lambda shape, c: [shape], lambda ts, shape, c: ts[0])

# GPT-2's Conv1D stores [in, out]; nn.Linear holds [out, in].
CONV1D = Transform("transpose (Conv1D [in, out])", lambda shape, c: [shape[::-1]],
                   lambda ts, shape, c: ts[0].t())

# No HF tensor (MPT's LayerNorms have no bias): tfport's equivalent is a zero bias.
ZEROS = Transform("zeros", lambda shape, c: [], lambda ts, shape, c: torch.zeros(shape))


def _rows(config: ModelConfig, part: str) -> int:
    return (config.n_heads if part == "q" else config.kv_heads) * config.dim_per_head


def concat_rows(*parts: str) -> Transform:
    """Separate projections stacked along the output rows, e.g. ``("q", "kv", "kv")`` for the
    fused ``qkv`` ([H*D | Hkv*D | Hkv*D] rows); weights [out, in] and biases [out] alike."""
    return Transform(
        f"concatenate rows {'|'.join(parts)}",
        lambda shape, c: [(_rows(c, p), *shape[1:]) for p in parts],
        lambda ts, shape, c: torch.cat(ts, dim=0))


QKV = concat_rows("q", "kv", "kv")


def _regroup_heads(ts: list[torch.Tensor], shape: Shape, c: ModelConfig) -> torch.Tensor:
    h, d = c.n_heads, c.dim_per_head
    rest = tuple(shape[1:])
    grouped = ts[0].reshape(h, 3, d, *rest)  # [H, 3, D, (E)]
    return grouped.transpose(0, 1).reshape(shape)  # [3, H, D, (E)] -> [q | k | v]


# BLOOM's query_key_value rows are per head (q_h, k_h, v_h); tfport's are [all q | all k | all v].
PER_HEAD_QKV = Transform("regroup rows [H, 3, D] -> [3, H, D]", lambda shape, c: [shape],
                         _regroup_heads)


# ------------------------------------------------------------------------------ mapping tables
@dataclass(frozen=True)
class Rule:
    """tfport tensor ``target`` (``{i}`` = layer index) is ``transform`` of HF ``sources``."""

    target: str
    sources: tuple[str, ...]
    transform: Transform = COPY
    when: Callable[[ModelConfig], bool] | None = None  # only for configs where this holds

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.target).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def params(target: str, sources: str | tuple[str, ...], weight: Transform = COPY,
           bias: Transform = COPY) -> list[Rule]:
    """Rules for a module's ``target.weight`` and ``target.bias`` from HF ``source.weight`` and
    ``source.bias``. tfport modules without a bias never ask for the second rule; ``bias=ZEROS``
    reads nothing (the HF module has no bias where tfport's has one)."""
    sources = (sources,) if isinstance(sources, str) else sources
    bias_sources = () if bias is ZEROS else tuple(f"{s}.bias" for s in sources)
    return [Rule(f"{target}.weight", tuple(f"{s}.weight" for s in sources), weight),
            Rule(f"{target}.bias", bias_sources, bias)]


@dataclass(frozen=True)
class Architecture:
    """One HF model family: which configs it accepts, how they translate, where tensors go.

    ``base_prefix`` is the base model's prefix inside the task models (``model.`` in
    ``LlamaForCausalLM``); base-model files (``LlamaModel``) lack it and get it added. ``ignored``
    maps a regular expression over HF keys to the reason those tensors are unused; ``duplicates``
    names HF keys that are tied copies of another HF key (checked equal when present).
    """

    model_types: tuple[str, ...]
    classes: tuple[str, ...]
    base_prefix: str
    config: Callable[[dict, frozenset[str] | None], ModelConfig]
    rules: tuple[Rule, ...]
    ignored: dict[str, str] = field(default_factory=dict)
    duplicates: dict[str, str] = field(default_factory=dict)

    @functools.cached_property
    def head_prefixes(self) -> tuple[str, ...]:
        """First components of HF keys outside the base model (``lm_head.``, ``cls.``)."""
        return tuple(sorted({rule.sources[0].split(".")[0] + "." for rule in self.rules
                             if rule.sources and not rule.sources[0].startswith(self.base_prefix)}))

    def rule(self, target: str, config: ModelConfig) -> tuple[Rule, dict[str, str]]:
        for rule in self.rules:
            match = rule.pattern.match(target)
            if match and (rule.when is None or rule.when(config)):
                return rule, match.groupdict()
        raise AssertionError(f"no HF rule for tfport tensor {target!r} ({self.model_types})")


def _decoder_lm(layer: str, embed: str, final_norm: str, norms: tuple[str, str], attn: list[Rule],
                ffn: list[Rule], norm_bias: Transform = COPY, extra: Iterable[Rule] = ()
                ) -> tuple[Rule, ...]:
    """The rules every decoder-only family shares, given its HF names for each part."""
    return (
        Rule("decoder.embed.tokens.weight", (embed,)),
        *params("decoder.layers.{i}.attn_norm", f"{layer}.{norms[0]}", bias=norm_bias),
        *attn,
        *params("decoder.layers.{i}.ffn_norm", f"{layer}.{norms[1]}", bias=norm_bias),
        *ffn,
        *params("decoder.norm", final_norm, bias=norm_bias),
        Rule("lm_head.weight", ("lm_head.weight",)),
        *extra,
    )


LLAMA_LAYER = "model.layers.{i}"
LLAMA = Architecture(
    model_types=("llama", "mistral"),
    classes=("LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel"),
    base_prefix="model.",
    config=_llama_config,
    rules=_decoder_lm(
        LLAMA_LAYER, "model.embed_tokens.weight", "model.norm",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv",
                      tuple(f"{LLAMA_LAYER}.self_attn.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{LLAMA_LAYER}.self_attn.o_proj")],
        ffn=[rule for p in ("gate", "up", "down")
             for rule in params(f"decoder.layers.{{i}}.ffn.{p}", f"{LLAMA_LAYER}.mlp.{p}_proj")]),
    ignored={r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
             "rotary frequencies are recomputed from rope_theta (older checkpoints saved them)"},
)

GPT2_LAYER = "transformer.h.{i}"
GPT2 = Architecture(
    model_types=("gpt2",),
    classes=("GPT2LMHeadModel", "GPT2Model"),
    base_prefix="transformer.",
    config=_gpt2_config,
    rules=_decoder_lm(
        GPT2_LAYER, "transformer.wte.weight", "transformer.ln_f", norms=("ln_1", "ln_2"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{GPT2_LAYER}.attn.c_attn", weight=CONV1D),
              *params("decoder.layers.{i}.attn.out", f"{GPT2_LAYER}.attn.c_proj", weight=CONV1D)],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{GPT2_LAYER}.mlp.c_fc", weight=CONV1D),
             *params("decoder.layers.{i}.ffn.down", f"{GPT2_LAYER}.mlp.c_proj", weight=CONV1D)],
        extra=[Rule("decoder.embed.positions.weight", ("transformer.wpe.weight",))]),
    ignored={r"transformer\.h\.\d+\.attn\.(bias|masked_bias)":
             "causal-mask buffers of older GPT-2 checkpoints; tfport builds masks from attention_mask"},
)

BERT_LAYER = "bert.encoder.layer.{i}"
BERT = Architecture(
    model_types=("bert",),
    classes=tuple(BERT_HEADS),
    base_prefix="bert.",
    config=_bert_config,
    rules=(
        Rule("encoder.embed.tokens.weight", ("bert.embeddings.word_embeddings.weight",)),
        Rule("encoder.embed.positions.weight", ("bert.embeddings.position_embeddings.weight",)),
        Rule("encoder.embed.token_types.weight", ("bert.embeddings.token_type_embeddings.weight",)),
        *params("encoder.embed.norm", "bert.embeddings.LayerNorm"),
        *params("encoder.layers.{i}.attn.qkv",
                tuple(f"{BERT_LAYER}.attention.self.{p}" for p in ("query", "key", "value")),
                weight=QKV, bias=QKV),
        *params("encoder.layers.{i}.attn.out", f"{BERT_LAYER}.attention.output.dense"),
        *params("encoder.layers.{i}.attn_norm", f"{BERT_LAYER}.attention.output.LayerNorm"),
        *params("encoder.layers.{i}.ffn.up", f"{BERT_LAYER}.intermediate.dense"),
        *params("encoder.layers.{i}.ffn.down", f"{BERT_LAYER}.output.dense"),
        *params("encoder.layers.{i}.ffn_norm", f"{BERT_LAYER}.output.LayerNorm"),
        *params("pooler", "bert.pooler.dense"),
        *params("mlm.dense", "cls.predictions.transform.dense"),
        *params("mlm.norm", "cls.predictions.transform.LayerNorm"),
        Rule("mlm.decoder.weight", ("cls.predictions.decoder.weight",)),
        Rule("mlm.decoder.bias", ("cls.predictions.bias",)),
    ),
    ignored={r"bert\.embeddings\.position_ids": "the buffer arange(max_positions); tfport "
             "counts positions from attention_mask",
             r"cls\.seq_relationship\.(weight|bias)": "the next-sentence-prediction head "
             "(BertForPreTraining); tfport's encoder has no such output"},
    duplicates={"cls.predictions.decoder.bias": "cls.predictions.bias"},
)

BLOOM_LAYER = "transformer.h.{i}"
BLOOM = Architecture(
    model_types=("bloom",),
    classes=("BloomForCausalLM", "BloomModel"),
    base_prefix="transformer.",
    config=_bloom_config,
    rules=_decoder_lm(
        BLOOM_LAYER, "transformer.word_embeddings.weight", "transformer.ln_f",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{BLOOM_LAYER}.self_attention.query_key_value",
                      weight=PER_HEAD_QKV, bias=PER_HEAD_QKV),
              *params("decoder.layers.{i}.attn.out", f"{BLOOM_LAYER}.self_attention.dense")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{BLOOM_LAYER}.mlp.dense_h_to_4h"),
             *params("decoder.layers.{i}.ffn.down", f"{BLOOM_LAYER}.mlp.dense_4h_to_h")],
        extra=params("decoder.embed.norm", "transformer.word_embeddings_layernorm")),
)

MPT_LAYER = "transformer.blocks.{i}"
MPT = Architecture(
    model_types=("mpt",),
    classes=("MptForCausalLM", "MptModel"),
    base_prefix="transformer.",
    config=_mpt_config,
    rules=_decoder_lm(
        MPT_LAYER, "transformer.wte.weight", "transformer.norm_f", norms=("norm_1", "norm_2"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{MPT_LAYER}.attn.Wqkv"),
              *params("decoder.layers.{i}.attn.out", f"{MPT_LAYER}.attn.out_proj")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{MPT_LAYER}.ffn.up_proj"),
             *params("decoder.layers.{i}.ffn.down", f"{MPT_LAYER}.ffn.down_proj")],
        norm_bias=ZEROS),
)

def _t5_stack(stack: str, hf: str, cross: bool) -> list[Rule]:
    """Rules of one T5 stack: ``{hf}.block.{i}.layer.N`` = self-attention, [cross-attention],
    feed-forward; the relative bias table lives in block 0 and serves every layer."""
    layer, block = f"{stack}.layers.{{i}}", f"{hf}.block.{{i}}"
    attn = f"{block}.layer.0.SelfAttention"
    ffn = f"{block}.layer.{2 if cross else 1}.DenseReluDense"
    rules = [
        Rule(f"{stack}.relative_bias.weight", (f"{hf}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
        Rule(f"{layer}.attn_norm.weight", (f"{block}.layer.0.layer_norm.weight",)),
        Rule(f"{layer}.attn.qkv.weight", tuple(f"{attn}.{p}.weight" for p in "qkv"), QKV),
        Rule(f"{layer}.attn.out.weight", (f"{attn}.o.weight",)),
        Rule(f"{layer}.ffn_norm.weight", (f"{block}.layer.{2 if cross else 1}.layer_norm.weight",)),
        Rule(f"{layer}.ffn.gate.weight", (f"{ffn}.wi_0.weight",)),
        Rule(f"{layer}.ffn.up.weight", (f"{ffn}.wi_1.weight",), when=lambda c: c.gated_ffn),
        Rule(f"{layer}.ffn.up.weight", (f"{ffn}.wi.weight",)),
        Rule(f"{layer}.ffn.down.weight", (f"{ffn}.wo.weight",)),
        Rule(f"{stack}.norm.weight", (f"{hf}.final_layer_norm.weight",)),
    ]
    if cross:
        cross_attn = f"{block}.layer.1.EncDecAttention"
        rules += [
            Rule(f"{layer}.cross_norm.weight", (f"{block}.layer.1.layer_norm.weight",)),
            Rule(f"{layer}.cross_attn.q.weight", (f"{cross_attn}.q.weight",)),
            Rule(f"{layer}.cross_attn.kv.weight", (f"{cross_attn}.k.weight", f"{cross_attn}.v.weight"),
                 concat_rows("kv", "kv")),
            Rule(f"{layer}.cross_attn.out.weight", (f"{cross_attn}.o.weight",)),
        ]
    return rules


T5 = Architecture(
    model_types=("t5",),
    classes=("T5ForConditionalGeneration", "T5Model"),
    base_prefix="",
    config=_t5_config,
    rules=(
        Rule("encoder.embed.tokens.weight", ("shared.weight",)),
        Rule("decoder.embed.tokens.weight", ("decoder.embed_tokens.weight",)),
        *_t5_stack("encoder", "encoder", cross=False),
        *_t5_stack("decoder", "decoder", cross=True),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
    duplicates={"encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight"},
)

ARCHITECTURES: dict[str, Architecture] = {
    model_type: arch for arch in (LLAMA, GPT2, BERT, BLOOM, MPT, T5) for model_type in arch.model_types}


def _architecture(hf: dict) -> Architecture:
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json: model_type={model_type!r} (architectures="
                         f"{hf.get('architectures')}) is not one tfport imports; expected one of "
                         f"{sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    classes = hf.get("architectures") or []
    unknown = [c for c in classes if c not in arch.classes]
    if unknown:
        raise ValueError(f"config.json: architectures={classes} of model_type={model_type!r}: "
                         f"tfport imports {list(arch.classes)}, not {unknown} (its head has no "
                         "tfport counterpart)")
    return arch


def hf_config_to_tfport(hf_config: dict, keys: Iterable[str] | None = None) -> ModelConfig:
    """The tfport ``ModelConfig`` of a Hugging Face ``config.json`` (as a dict).

    ``keys``, the checkpoint's tensor names if known, settles which optional heads exist (BERT's
    pooler and MLM head); without them the ``architectures`` class decides. Raises ``ValueError``
    for an unknown architecture or an option tfport cannot compute exactly.
    """
    if not isinstance(hf_config, dict):
        raise TypeError(f"hf_config: expected the dict of a config.json, got {type(hf_config).__name__}")
    arch = _architecture(hf_config)
    normalized = None if keys is None else frozenset(_normalize(k, arch) for k in keys)
    return arch.config(hf_config, normalized)


# ---------------------------------------------------------------------------------- tensor files
def _normalize(key: str, arch: Architecture) -> str:
    """HF key as the task model names it: base-model files (``LlamaModel``) lack the prefix."""
    if key.startswith((arch.base_prefix, *arch.head_prefixes)):
        return key
    return arch.base_prefix + key


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of ``directory`` -- one file, or the shards its index lists -- and
    the index's tensor name -> shard map (None for one file)."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single], None
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' of tensor name -> shard file")
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in shards if not p.is_file()]
        if absent:
            raise ValueError(f"{index} lists shard(s) {absent} that are not in {directory}")
        return shards, weight_map
    present = sorted(p.name for p in directory.iterdir() if p.is_file())
    pickled = [name for name in present if name.endswith(PICKLED_SUFFIXES) or name.endswith(".bin.index.json")]
    shards = [name for name in present if name.endswith(".safetensors")]
    found = (f"it has {pickled}, pickled weights that tfport never loads (unpickling runs code); "
             "convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True))"
             if pickled else f"it has {present}")
    if shards:
        found = f"it has safetensors shards {shards} but no {INDEX_FILE}"
    raise ValueError(f"checkpoint={str(directory)!r}: no {WEIGHTS_FILE} or {INDEX_FILE}; {found}")


class _Tensors:
    """HF tensors by (normalized) name across one or more safetensors files, read lazily."""

    def __init__(self, directory: Path, arch: Architecture):
        self.directory = directory
        self.handles = {}
        self.file: dict[str, Path] = {}  # normalized key -> file
        self.original: dict[str, str] = {}  # normalized key -> key as stored
        files, weight_map = _weight_files(directory)
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
            self.handles[path] = handle
            for key in handle.keys():
                name = _normalize(key, arch)
                if name in self.file:
                    raise ValueError(f"{path}: tensor {key!r} is also in {self.file[name].name}")
                self.file[name], self.original[name] = path, key
        if weight_map is not None:
            stray = sorted(f"{key} (in {shard} says {INDEX_FILE})" for key, shard in weight_map.items()
                           if self.file.get(_normalize(key, arch), Path()).name != shard)
            if stray:
                raise ValueError(f"{directory}: tensors not where the index puts them: "
                                 f"{stray[:MAX_LISTED]}")

    def __contains__(self, name: str) -> bool:
        return name in self.file

    def keys(self) -> frozenset[str]:
        return frozenset(self.file)

    def where(self, name: str) -> str:
        """``file: key`` for messages."""
        return f"{self.file[name].name}: {self.original[name]}"

    def shape(self, name: str) -> Shape:
        return tuple(self.handles[self.file[name]].get_slice(self.original[name]).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self.handles[self.file[name]].get_tensor(self.original[name]).float()


# ----------------------------------------------------------------------------------- loading
@dataclass
class _Plan:
    """What loading found: per tfport tensor its sources, and every problem."""

    loads: list[tuple[str, Rule, tuple[str, ...]]] = field(default_factory=list)
    tied: list[tuple[str, str, Rule, tuple[str, ...]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)


def _plan(model: nn.Module, arch: Architecture, tensors: _Tensors) -> _Plan:
    config: ModelConfig = model.config
    canonical, aliases = _aliases(model)
    plan = _Plan()

    def sources(target: str, shape: Shape) -> tuple[Rule, tuple[str, ...], bool]:
        rule, groups = arch.rule(target, config)
        names = tuple(s.format(**groups) for s in rule.sources)
        ok = True
        for name, expected in zip(names, rule.transform.shapes(shape, config)):
            if name not in tensors:
                ok = False
                plan.missing.append(f"{name} (for {target})")
            elif tensors.shape(name) != tuple(expected):
                ok = False
                plan.mismatched.append(f"{tensors.where(name)} has shape {tensors.shape(name)}, "
                                       f"expected {tuple(expected)} (for {target}: "
                                       f"{rule.transform.name})")
            plan.used.add(name)
        return rule, names, ok

    for target, tensor in canonical.items():
        rule, names, ok = sources(target, tuple(tensor.shape))
        if ok:
            plan.loads.append((target, rule, names))
    for alias, target in aliases.items():  # tied copies HF may or may not have saved
        rule, groups = arch.rule(alias, config)
        names = tuple(s.format(**groups) for s in rule.sources)
        if names and all(name in tensors for name in names):
            rule, names, ok = sources(alias, tuple(canonical[target].shape))
            if ok:
                plan.tied.append((alias, target, rule, names))
    return plan


def _problems(plan: _Plan, arch: Architecture, tensors: _Tensors) -> list[str]:
    ignored = [re.compile(pattern + "$") for pattern in arch.ignored]
    duplicates = {copy for copy, original in arch.duplicates.items()
                  if copy in tensors and original in plan.used}
    unexpected = sorted(
        f"{tensors.where(name)} {tensors.shape(name)}" for name in tensors.keys()
        if name not in plan.used and name not in duplicates
        and not any(p.match(name) for p in ignored))

    def listed(items: list[str]) -> str:
        more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
        return "; ".join(items[:MAX_LISTED]) + more

    problems = []
    if plan.missing:
        problems.append(f"missing key(s): {listed(plan.missing)}")
    if unexpected:
        problems.append(f"unexpected key(s): {listed(unexpected)} (ignored on purpose: "
                        f"{sorted(arch.ignored) or 'none'})")
    if plan.mismatched:
        problems.append(f"shape mismatch(es): {listed(plan.mismatched)}")
    return problems


def _build(rule: Rule, names: tuple[str, ...], shape: Shape, config: ModelConfig,
           tensors: _Tensors) -> torch.Tensor:
    out = rule.transform.apply([tensors.get(name) for name in names], shape, config)
    assert tuple(out.shape) == shape, (rule, tuple(out.shape), shape)
    return out


def load_hf_model(path: str | os.PathLike) -> nn.Module:
    """The tfport reference module (eval mode, ``.config`` set) of a Hugging Face checkpoint.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
    and its shards). Raises ``ValueError`` naming the file, key and shape on an unknown
    architecture, a missing, unexpected or mis-shaped tensor, or pickled weights only.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"checkpoint={str(path)!r}: not a directory (expected {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE} from a Hugging Face save_pretrained)")
    if not (directory / CONFIG_FILE).is_file():
        raise ValueError(f"checkpoint={str(path)!r}: no {CONFIG_FILE}")
    hf = _read_json(directory / CONFIG_FILE)
    arch = _architecture(hf)
    tensors = _Tensors(directory, arch)
    config = arch.config(hf, tensors.keys())
    model = build_model(config)
    plan = _plan(model, arch, tensors)
    problems = _problems(plan, arch, tensors)
    if problems:
        raise ValueError(f"checkpoint={str(directory)!r} ({hf.get('model_type')}) does not map onto "
                         f"tfport's modules: " + " | ".join(problems))
    canonical, _ = _aliases(model)
    with torch.no_grad():
        for target, rule, names in plan.loads:
            tensor = canonical[target]
            tensor.copy_(_build(rule, names, tuple(tensor.shape), config, tensors))
        for alias, target, rule, names in plan.tied:
            saved = _build(rule, names, tuple(canonical[target].shape), config, tensors)
            if not torch.equal(saved, canonical[target]):
                raise ValueError(f"checkpoint={str(directory)!r}: {', '.join(map(tensors.where, names))} "
                                 f"differs from the tensor it is tied to ({target}); the config ties "
                                 "them (tie_word_embeddings), so they must be equal")
        for copy, original in arch.duplicates.items():
            if copy in tensors and original in plan.used and not torch.equal(tensors.get(copy), tensors.get(original)):
                raise ValueError(f"checkpoint={str(directory)!r}: {tensors.where(copy)} differs from "
                                 f"{tensors.where(original)}, of which it is a tied copy")
    log.info("imported %s checkpoint %s (%d tensors)", hf.get("model_type"), directory, len(plan.loads))
    return model.eval()


__all__ = ["is_hf_checkpoint", "hf_config_to_tfport", "load_hf_model", "ARCHITECTURES",
           "Architecture", "Rule", "Transform", "params", "concat_rows"]
