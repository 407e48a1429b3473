"""ModernBERT (``model_type`` ``modernbert``) -> encoder.

Pre-norm LayerNorm encoder with RoPE and no position table: token embeddings + LayerNorm, then
layers whose first has no attention norm (``first_attn_norm=False``: the embedding norm precedes
it), a fused ``Wqkv`` ([q | k | v] rows), GeGLU with a fused ``Wi`` whose first half gets the
activation (``ffn.gate``) and second half multiplies it (``ffn.up``), and a final norm. Every
``global_attn_every_n_layers``-th layer (``layer_types`` ``full_attention``) attends globally with
the ``full_attention`` RoPE base (``global_rope_theta``); the others (``sliding_attention``) see
keys at most ``local_attention // 2`` positions away on either side (tfport's encoder
``sliding_window`` = ``local_attention``) with their own base (``local_rope_theta`` ->
``rope.local_theta``). Biases are optional per part (``attention_bias``, ``mlp_bias``,
``norm_bias``; the head's ``classifier_bias``, the MLM ``decoder_bias``): where tfport's module
has a bias the checkpoint lacks, it is zero, which is exact.

Heads: MLM (``head``: dense -> ``classifier_activation`` -> LayerNorm, then ``decoder``, tied to
the token embeddings) and sequence classification (``classifier_pooling`` cls / mean -> ``head``
-> ``classifier``: tfport's ClassifierHead with ``classifier.norm``). Ignored on purpose, as they
do not change inference: ``deterministic_flash_attn``, ``reference_compile``, ``sparse_prediction``
(which drops unmasked positions only when labels are given), the dropouts.

transformers numbers positions 0..S-1 by slot (and measures windows in slots); tfport counts real
tokens. They agree on right-padded rows, as ModernBERT's tokenizer pads; for left padding give
transformers ``position_ids`` counted from the mask (its windows then agree too, padded keys being
masked).
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.checks import is_int
from tfport.config.window import WindowConfig

from .configs import HF_ACTIVATIONS, hf_field, refuse, rope_fields, token_ids
from .heads import CLASSIFIER, MLM, classifier_fields
from .rules import ZEROS, Architecture, Rule, half_rows, params

CLASSES = {"ModernBertModel": (), "ModernBertForMaskedLM": (MLM,),
           "ModernBertForSequenceClassification": (CLASSIFIER,)}
HEAD_KEY, CLASSIFIER_KEY = "head.dense.weight", "classifier.weight"
LAYER_TYPES = ("full_attention", "sliding_attention")


def _heads(hf: dict, keys: frozenset[str] | None) -> tuple[str, ...]:
    """The task head: both heads share ``head.*``; ``classifier.*`` tells them apart."""
    if keys is not None:
        if CLASSIFIER_KEY in keys:
            return (CLASSIFIER,)
        return (MLM,) if HEAD_KEY in keys else ()
    return CLASSES[(hf.get("architectures") or ["ModernBertModel"])[0]]


def _layer_types(hf: dict, n_layers: int) -> list[str]:
    """``layer_types`` (transformers 5), else every ``global_attn_every_n_layers``-th global."""
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("global_attn_every_n_layers", 3)
        if not is_int(every) or every <= 0:
            refuse(hf, "global_attn_every_n_layers", every, "expected a positive integer")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - set(LAYER_TYPES):
        refuse(hf, "layer_types", types, f"expected {n_layers} entries of {list(LAYER_TYPES)}")
    return types


def _rope(hf: dict) -> tuple[dict, float]:
    """RoPE fields of the global layers and the local layers' base (both unscaled)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
        refuse(hf, "rope_parameters", params, f"expected an object keyed by {list(LAYER_TYPES)}")
    if hf.get("rope_scaling") is not None:  # transformers applies it to both layer types
        refuse(hf, "rope_scaling", hf["rope_scaling"], "tfport gives ModernBERT's layers plain RoPE")
    full = {"rope_theta": hf.get("global_rope_theta", 160000.0), **(params.get("full_attention") or {})}
    local = {"rope_theta": hf.get("local_rope_theta", 10000.0), **(params.get("sliding_attention") or {})}
    for name, part in (("full_attention", full), ("sliding_attention", local)):
        kind = part.get("rope_type", "default")
        if kind != "default":
            refuse(hf, f"rope_parameters.{name}.rope_type", kind, "tfport gives ModernBERT's layers "
                   "plain RoPE (no scaling)")
    return rope_fields(hf, full), float(local["rope_theta"])


def _activation(hf: dict, field: str, names: dict[str, str]) -> str:
    """tfport's name of activation ``field`` (default GELU), one of ``names`` (HF -> tfport)."""
    name = hf.get(field, "gelu")
    if name not in names:
        refuse(hf, field, name, f"tfport computes {sorted(names)}")
    return names[name]


def _check_biases(hf: dict, keys: frozenset[str] | None, heads: tuple[str, ...]) -> None:
    """The optional biases the config announces are the ones the file holds."""
    if keys is None:
        return
    expected = [("norm_bias", "model.final_norm.bias"), ("attention_bias", "model.layers.0.attn.Wqkv.bias"),
                ("mlp_bias", "model.layers.0.mlp.Wi.bias")]
    if heads:
        expected.append(("classifier_bias", "head.dense.bias"))
    if MLM in heads:
        expected.append(("decoder_bias", "decoder.bias"))
    defaults = {"decoder_bias": True}
    for field, key in expected:
        flag = bool(hf.get(field, defaults.get(field, False)))
        if flag != (key in keys):
            refuse(hf, field, hf.get(field), f"the checkpoint {'lacks' if flag else 'has'} {key}")


def _modernbert_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    heads = _heads(hf, keys)
    _check_biases(hf, keys, heads)
    n_layers = hf_field(hf, "num_hidden_layers")
    vocab_size = hf_field(hf, "vocab_size")
    activation = _activation(hf, "hidden_activation", HF_ACTIVATIONS)
    head_activation = _activation(hf, "classifier_activation", {**HF_ACTIVATIONS, "tanh": "tanh"})
    if MLM in heads and head_activation != activation:
        refuse(hf, "classifier_activation", hf.get("classifier_activation"), "the MLM head applies "
               f"tfport's model activation, here hidden_activation={hf.get('hidden_activation')!r}")
    pooling = hf.get("classifier_pooling", "cls")
    if CLASSIFIER in heads and pooling not in ("cls", "mean"):
        refuse(hf, "classifier_pooling", pooling, "tfport pools 'cls' or 'mean'")
    window = hf.get("local_attention", 128)
    if not is_int(window) or window <= 0:
        refuse(hf, "local_attention", window, "expected a positive integer")
    local = tuple(i for i, t in enumerate(_layer_types(hf, n_layers)) if t == "sliding_attention")
    rope, local_theta = _rope(hf)
    if local:
        rope = {"rope": rope["rope"].replace(local_theta=local_theta)}
    head = dict(pooling=pooling, activation=head_activation, norm=True) if CLASSIFIER in heads else {}
    sliding = {"window": WindowConfig(window, None if len(local) == n_layers else local)} if local else {}
    return ModelConfig(
        family="encoder", vocab_size=vocab_size, d_model=hf_field(hf, "hidden_size"),
        n_heads=hf_field(hf, "num_attention_heads"), d_ff=hf_field(hf, "intermediate_size"),
        n_encoder_layers=n_layers, norm="layernorm", norm_position="pre",
        norm_eps=float(hf_field(hf, "norm_eps", default=1e-5)), activation=activation, gated_ffn=True,
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=8192),
        **rope, **sliding, attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)), embedding_norm=True, first_attn_norm=False,
        mlm_head=MLM in heads, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **classifier_fields(hf, CLASSIFIER in heads, **head), **token_ids(hf, vocab_size))


def _optional_params(target: str, source: str) -> list[Rule]:
    """``target``'s weight and bias; the bias is zero where the file has none (checked against
    the config's bias flags by ``_check_biases``)."""
    weight, bias = params(target, source)
    return [weight, Rule(bias.target, bias.sources, if_present=True), params(target, source, bias=ZEROS)[1]]


LAYER = "model.layers.{i}"
MODERNBERT = Architecture(
    model_types=("modernbert",),
    classes=tuple(CLASSES),
    base_prefix="model.",
    config=_modernbert_config,
    rules=(
        Rule("encoder.embed.tokens.weight", ("model.embeddings.tok_embeddings.weight",)),
        *_optional_params("encoder.embed.norm", "model.embeddings.norm"),
        *_optional_params("encoder.layers.{i}.attn_norm", f"{LAYER}.attn_norm"),  # none in layer 0
        *params("encoder.layers.{i}.attn.qkv", f"{LAYER}.attn.Wqkv"),
        *params("encoder.layers.{i}.attn.out", f"{LAYER}.attn.Wo"),
        *_optional_params("encoder.layers.{i}.ffn_norm", f"{LAYER}.mlp_norm"),
        *params("encoder.layers.{i}.ffn.gate", f"{LAYER}.mlp.Wi", weight=half_rows(0), bias=half_rows(0)),
        *params("encoder.layers.{i}.ffn.up", f"{LAYER}.mlp.Wi", weight=half_rows(1), bias=half_rows(1)),
        *params("encoder.layers.{i}.ffn.down", f"{LAYER}.mlp.Wo"),
        *_optional_params("encoder.norm", "model.final_norm"),
        *_optional_params("mlm.dense", "head.dense"),
        *_optional_params("mlm.norm", "head.norm"),
        *_optional_params("mlm.decoder", "decoder"),  # weight: tied to the tokens unless untied
        *_optional_params(f"{CLASSIFIER}.dense", "head.dense"),
        *_optional_params(f"{CLASSIFIER}.norm", "head.norm"),
        *params(f"{CLASSIFIER}.out", "classifier"),
    ),
)
