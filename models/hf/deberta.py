"""DeBERTa-v3 (``model_type`` ``deberta-v2``) -> encoder with ``position="disentangled"``.

BERT's post-norm layout under ``deberta.``, without absolute positions: every layer adds
DeBERTa's disentangled terms (``tfport.models.disentangled``) computed from the shared relative
embeddings (``encoder.rel_embeddings``, LayerNorm'd by ``encoder.LayerNorm``) projected by the
layer's own ``query_proj`` / ``key_proj`` (``share_att_key``). ``query/key/value_proj`` are
stacked into ``qkv``. Heads: MLM (legacy ``cls.predictions.*`` or ``lm_predictions.lm_head.*``:
dense, activation, LayerNorm, decoder tied to the word embeddings, bias) and sequence
classification (``pooler.dense`` + ``pooler_hidden_act`` on the first token, then
``classifier``: tfport's ClassifierHead with that activation) when the file has them.

Only the v3 form is imported (``relative_attention`` true, ``position_biased_input`` false,
``share_att_key`` true, ``norm_rel_ebd`` "layer_norm", no convolution layer, ``embedding_size`` =
``hidden_size``); other variants are refused by field and value. transformers numbers relative
positions by slot and tfport's module does too, so left and right padding both match it at real
tokens. Padded positions differ, by design: transformers zeroes padded embeddings and lets padded
queries attend uniformly to every key; tfport's padded queries attend to the real keys.
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.classifier import CLASSIFIER_ACTIVATIONS
from tfport.config.positions import DISENTANGLED_TERMS, DisentangledConfig

from .configs import hf_activation, hf_field, refuse, token_ids
from .heads import CLASSIFIER, MLM, classifier_fields
from .rules import QKV, Architecture, Rule, params

LEGACY_MLM, MLM_HEAD = "cls.predictions", "lm_predictions.lm_head"  # the two MLM head layouts
HEAD_KEYS = {MLM: (f"{LEGACY_MLM}.transform.dense.weight", f"{MLM_HEAD}.dense.weight"),
             CLASSIFIER: ("classifier.weight",)}
CLASSES = {"DebertaV2Model": (), "DebertaV2ForMaskedLM": (MLM,),
           "DebertaV2ForSequenceClassification": (CLASSIFIER,)}


def _heads(hf: dict, keys: frozenset[str] | None) -> set[str]:
    if keys is not None:
        return {head for head, names in HEAD_KEYS.items() if any(name in keys for name in names)}
    return set(CLASSES[(hf.get("architectures") or ["DebertaV2Model"])[0]])


def _terms(hf: dict) -> tuple[str, ...]:
    """``pos_att_type`` ("p2c|c2p" or a list) as tfport's ``disentangled.terms`` (null: both)."""
    value = hf.get("pos_att_type")
    names = [x.strip() for x in value.lower().split("|")] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not set(names) <= set(DISENTANGLED_TERMS) \
            or len(set(names)) != len(names):
        refuse(hf, "pos_att_type", value, f"expected distinct terms from {list(DISENTANGLED_TERMS)} "
               "(DeBERTa-v3: 'p2c|c2p')")
    terms = tuple(t for t in DISENTANGLED_TERMS if t in names)
    return None if terms == DISENTANGLED_TERMS else terms


def _refuse_variants(hf: dict) -> None:
    """Refuse, by field and value, what is not DeBERTa-v3's form."""
    required = {"relative_attention": (False, True), "position_biased_input": (True, False),
                "share_att_key": (False, True)}  # field -> (transformers' default, what tfport maps)
    for field, (default, expected) in required.items():
        if hf.get(field, default) is not expected:
            refuse(hf, field, hf.get(field, default), f"tfport maps DeBERTa-v3, whose {field} is "
                   f"{str(expected).lower()}")
    norm = [x.strip() for x in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
    if norm != ["layer_norm"]:
        refuse(hf, "norm_rel_ebd", hf.get("norm_rel_ebd", "none"), "tfport maps DeBERTa-v3's "
               "'layer_norm' (the relative embeddings normalised once per call)")
    if (hf.get("conv_kernel_size") or 0) > 0:
        refuse(hf, "conv_kernel_size", hf["conv_kernel_size"], "the convolution after the first layer "
               "(DeBERTa-v2 xlarge/xxlarge) has no tfport counterpart; expected 0 or absent")
    hidden = hf_field(hf, "hidden_size")
    for field in ("embedding_size", "pooler_hidden_size"):
        if hf.get(field, hidden) != hidden:
            refuse(hf, field, hf[field], f"expected hidden_size={hidden}")
    buckets = hf.get("position_buckets", -1)
    if buckets > 0 and (buckets < 4 or buckets % 2):
        refuse(hf, "position_buckets", buckets, "expected an even count >= 4 (or <= 0: no buckets)")


def _classifier_activation(hf: dict) -> str:
    name = hf.get("pooler_hidden_act", "gelu")
    activation = name if name == "tanh" else hf_activation(hf, name)
    if activation not in CLASSIFIER_ACTIVATIONS:
        refuse(hf, "pooler_hidden_act", name, f"tfport's classifier computes {list(CLASSIFIER_ACTIVATIONS)}")
    return activation


def _deberta_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """DeBERTa-v3: post-norm LayerNorm, disentangled relative attention, no absolute positions."""
    _refuse_variants(hf)
    heads = _heads(hf, keys)
    vocab_size, hidden = hf_field(hf, "vocab_size"), hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    max_positions = hf_field(hf, "max_position_embeddings", default=512)
    distance = hf.get("max_relative_positions", -1)
    buckets = hf.get("position_buckets", -1)
    # lm_predictions' decoder is always the word embeddings; the legacy head follows the config.
    lm_predictions = (f"{MLM_HEAD}.dense.weight" in keys if keys is not None
                      else hf.get("legacy", True) is False)
    tie = True if lm_predictions else bool(hf.get("tie_word_embeddings", True))
    return ModelConfig(
        family="encoder", vocab_size=vocab_size, d_model=hidden, n_heads=n_heads,
        head_dim=hf.get("attention_head_size"), d_ff=hf_field(hf, "intermediate_size"),
        n_encoder_layers=hf_field(hf, "num_hidden_layers"), norm="layernorm", norm_position="post",
        norm_eps=float(hf_field(hf, "layer_norm_eps", default=1e-7)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="gelu")),
        position="disentangled", max_positions=max_positions,
        disentangled=DisentangledConfig(buckets=buckets if buckets > 0 else None,
                                        max_distance=distance if distance >= 1 else max_positions,
                                        terms=_terms(hf)), embedding_norm=True,
        type_vocab_size=hf_field(hf, "type_vocab_size", default=0), mlm_head=MLM in heads,
        tie_embeddings=tie, **classifier_fields(hf, CLASSIFIER in heads, activation=_classifier_activation(hf)),
        **token_ids(hf, vocab_size))


def _legacy_mlm(target: str, source: str) -> Rule:
    """Legacy MLM head tensors, where the file has them (else the lm_predictions rules apply)."""
    return Rule(target, (f"{LEGACY_MLM}.{source}",), if_present=True)


EMB, LAYER = "deberta.embeddings", "deberta.encoder.layer.{i}"
DEBERTA = Architecture(
    model_types=("deberta-v2",),
    classes=tuple(CLASSES),
    base_prefix="deberta.",
    config=_deberta_config,
    rules=(
        Rule("encoder.embed.tokens.weight", (f"{EMB}.word_embeddings.weight",)),
        Rule("encoder.embed.token_types.weight", (f"{EMB}.token_type_embeddings.weight",)),
        *params("encoder.embed.norm", f"{EMB}.LayerNorm"),
        Rule("encoder.relative_embeddings.weight", ("deberta.encoder.rel_embeddings.weight",)),
        *params("encoder.relative_norm", "deberta.encoder.LayerNorm"),
        *params("encoder.layers.{i}.attn.qkv",
                tuple(f"{LAYER}.attention.self.{p}_proj" for p in ("query", "key", "value")),
                weight=QKV, bias=QKV),
        *params("encoder.layers.{i}.attn.out", f"{LAYER}.attention.output.dense"),
        *params("encoder.layers.{i}.attn_norm", f"{LAYER}.attention.output.LayerNorm"),
        *params("encoder.layers.{i}.ffn.up", f"{LAYER}.intermediate.dense"),
        *params("encoder.layers.{i}.ffn.down", f"{LAYER}.output.dense"),
        *params("encoder.layers.{i}.ffn_norm", f"{LAYER}.output.LayerNorm"),
        *(_legacy_mlm(f"mlm.{part}.{p}", f"transform.{name}.{p}")
          for part, name in (("dense", "dense"), ("norm", "LayerNorm")) for p in ("weight", "bias")),
        _legacy_mlm("mlm.decoder.bias", "bias"),
        Rule("mlm.decoder.weight", (f"{LEGACY_MLM}.decoder.weight",)),  # tied unless the config unties it
        *params("mlm.dense", f"{MLM_HEAD}.dense"),
        *params("mlm.norm", f"{MLM_HEAD}.LayerNorm"),
        Rule("mlm.decoder.bias", (f"{MLM_HEAD}.bias",)),
        *params(f"{CLASSIFIER}.dense", "pooler.dense"),
        *params(f"{CLASSIFIER}.out", "classifier"),
    ),
    ignored={r"deberta\.embeddings\.position_ids": "a buffer; DeBERTa-v3 has no absolute positions",
             r"mask_predictions\..*": "the replaced-token-detection head of pre-training (transformers "
             "ignores it too)"},
    duplicates={f"{LEGACY_MLM}.decoder.bias": f"{LEGACY_MLM}.bias"},
)
