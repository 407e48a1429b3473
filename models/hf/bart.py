"""BART and mBART (``model_type`` ``bart``, ``mbart``) -> encoder-decoder.

Both stacks: token embeddings (one table, ``shared``) times sqrt(d_model) when
``scale_embedding``, plus a learned position table, then ``layernorm_embedding``
(tfport's ``embedding_norm``). BART's blocks are post-norm; mBART's are pre-norm and each stack
ends with its own ``layer_norm`` (tfport's final norm of a pre-norm stack). Attention and FFN
have biases; q/k/v are stacked into ``qkv`` (cross-attention: ``q`` and stacked ``kv``). The head
is tied to ``shared`` (unless ``tie_word_embeddings`` is false and the file has ``lm_head``) and
adds ``final_logits_bias`` [1, V] (tfport's ``lm_head_bias``) when the file holds it.

``*ForSequenceClassification`` (BART-large-MNLI's zero-shot head): ``classification_head``
(dense, tanh, out_proj) becomes tfport's ClassifierHead with ``classifier.pooling="last_eos"``:
the decoder reads the input ids shifted right, and the head reads its state at each row's last
eos (``EncoderDecoderLM.classify``); labels from ``id2label``. BART's decoder starts from
``decoder_start_token_id``; mBART's (its own ``shift_tokens_right``) from each row's last real
token, the language id its tokenizer appends (``classifier.decoder_start="last_token"``).

Positions: transformers reads row ``k + 2`` of each table for position k (the offset fairseq left
for its padding rows), so tfport keeps the rows from 2 on and counts from 0, as
``roberta`` does with its rows after ``padding_idx``. Transformers' positions are the slot index
``arange(S)`` (plus the cache length in the decoder) whatever the mask; tfport counts real tokens.
The two agree under right padding -- what BART's tokenizers produce and what tfport's runtime
feeds the encoder -- and differ for left-padded encoder inputs given to the module directly.

``marian`` builds on the layer rules here (``bart_stack``, ``bart_head``).
"""

from __future__ import annotations

import math

from tfport.config import ModelConfig
from tfport.config.checks import is_int

from .configs import hf_activation, hf_field, refuse, token_ids
from .heads import classifier_fields
from .rules import QKV, Architecture, Rule, Transform, concat_rows, params

OFFSET = 2  # BartLearnedPositionalEmbedding: position k reads row k + 2

POSITIONS = Transform(f"rows from {OFFSET} on (BART's position offset)",
                      lambda shape, c: [(shape[0] + OFFSET, shape[1])], lambda ts, shape, c: ts[0][OFFSET:])
LOGITS_BIAS = Transform("final_logits_bias [1, V] -> [V]", lambda shape, c: [(1, shape[0])],
                        lambda ts, shape, c: ts[0].reshape(shape))

BIAS_KEY = "final_logits_bias"
# BartForSequenceClassification's head: top-level ``classification_head.*``.
CLASSIFIER_KEY = "classification_head.out_proj.weight"
CLASSIFIER_CLASSES = ("BartForSequenceClassification", "MBartForSequenceClassification")
# Fields of the first BART configs (transformers < 3.1) that transformers now ignores: the
# model_type decides. tfport refuses a config whose field says otherwise than that model_type's
# computation rather than guess which of the two the weights were trained with.
LEGACY = ("normalize_before", "add_final_layer_norm", "normalize_embedding", "static_position_embeddings",
          "add_bias_logits")


def shared_sizes(hf: dict) -> dict:
    """d_model, heads, FFN width and layer counts of a BART-layout config; both stacks must have
    the same heads and FFN width (tfport's stacks share one ``n_heads`` and ``d_ff``)."""
    for encoder, decoder in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf_field(hf, encoder) != hf_field(hf, decoder):
            refuse(hf, decoder, hf[decoder], f"tfport's encoder and decoder share one width; "
                   f"expected {encoder}={hf[encoder]}")
    return dict(d_model=hf_field(hf, "d_model"), n_heads=hf_field(hf, "encoder_attention_heads"),
                d_ff=hf_field(hf, "encoder_ffn_dim"), n_encoder_layers=hf_field(hf, "encoder_layers"),
                n_decoder_layers=hf_field(hf, "decoder_layers"))


def head_fields(hf: dict, keys: frozenset[str] | None, lm_classes: tuple[str, ...]) -> dict:
    """``tie_embeddings`` (``tie_word_embeddings``) and ``lm_head_bias``: whether the file holds
    ``final_logits_bias`` (without keys: whether the class is one with an LM head, which keeps it
    as a buffer)."""
    classes = hf.get("architectures") or []
    bias = BIAS_KEY in keys if keys is not None else any(c in lm_classes for c in classes)
    return dict(tie_embeddings=hf.get("tie_word_embeddings", True) is not False, lm_head_bias=bias)


def classifier_head(hf: dict, keys: frozenset[str] | None) -> dict:
    """``classifier`` (labels, pooling) of a sequence classification head, when the file
    holds ``classification_head`` (without keys: when the class is a ``*ForSequenceClassification``)."""
    present = CLASSIFIER_KEY in keys if keys is not None else \
        (hf.get("architectures") or [""])[0] in CLASSIFIER_CLASSES
    if not present:
        return {}
    start = "last_token" if hf.get("model_type") == "mbart" else "start_token"
    return classifier_fields(hf, True, pooling="last_eos", activation="tanh", decoder_start=start)


def start_token(hf: dict, ids: dict, default: int | None) -> int:
    """``decoder_start_token_id``, else ``default`` (transformers' generate falls back to bos)."""
    start = hf.get("decoder_start_token_id")
    start = default if start is None else start
    if not is_int(start) or not 0 <= start < hf_field(hf, "vocab_size"):
        refuse(hf, "decoder_start_token_id", start, "a token id of the vocabulary (decoding starts from it)")
    return start


def _bart_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """BART (post-norm) or mBART (pre-norm, each stack's final ``layer_norm``)."""
    pre = hf.get("model_type") == "mbart"
    expected = {"normalize_before": pre, "add_final_layer_norm": pre, "normalize_embedding": True,
                "static_position_embeddings": False, "add_bias_logits": False}
    for name in LEGACY:
        if hf.get(name) is not None and hf[name] != expected[name]:
            refuse(hf, name, hf[name], f"transformers computes model_type={hf.get('model_type')!r} as "
                   f"{name}={expected[name]} whatever this field says; expected it to agree")
    if hf.get("extra_pos_embeddings", OFFSET) != OFFSET:
        refuse(hf, "extra_pos_embeddings", hf["extra_pos_embeddings"], f"BART reads positions at an "
               f"offset of {OFFSET}")
    sizes = shared_sizes(hf)
    vocab_size = hf_field(hf, "vocab_size")
    ids = token_ids(hf, vocab_size)
    scale = math.sqrt(sizes["d_model"]) if hf.get("scale_embedding") else 1.0
    return ModelConfig(
        family="encoder-decoder", vocab_size=vocab_size, **sizes, norm="layernorm",
        norm_position="pre" if pre else "post", norm_eps=1e-5,  # nn.LayerNorm's default
        activation=hf_activation(hf, hf_field(hf, "activation_function", default="gelu")),
        position="learned", max_positions=hf_field(hf, "max_position_embeddings", default=1024),
        embedding_norm=True, embedding_scale=scale, attention_bias=True, mlp_bias=True,
        **head_fields(hf, keys, ("BartForConditionalGeneration", "MBartForConditionalGeneration")),
        **classifier_head(hf, keys), decoder_start_token_id=start_token(hf, ids, ids["bos_token_id"]), **ids)


def bart_stack(stack: str, hf: str, cross: bool, positions: list[Rule], norms: bool) -> list[Rule]:
    """Rules of one BART-layout stack: tfport ``stack`` from HF ``hf`` (``model.encoder``).

    ``positions`` are the rules of its position table; ``norms`` adds ``layernorm_embedding`` and
    the final ``layer_norm`` (asked for only by configs whose stacks have them)."""
    layer, block = f"{stack}.layers.{{i}}", f"{hf}.layers.{{i}}"
    attn = f"{block}.self_attn"
    rules = [
        *positions,
        *params(f"{layer}.attn.qkv", tuple(f"{attn}.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
        *params(f"{layer}.attn.out", f"{attn}.out_proj"),
        *params(f"{layer}.attn_norm", f"{block}.self_attn_layer_norm"),
        *params(f"{layer}.ffn.up", f"{block}.fc1"),
        *params(f"{layer}.ffn.down", f"{block}.fc2"),
        *params(f"{layer}.ffn_norm", f"{block}.final_layer_norm"),
    ]
    if norms:
        rules += [*params(f"{stack}.embed.norm", f"{hf}.layernorm_embedding"),
                  *params(f"{stack}.norm", f"{hf}.layer_norm")]
    if cross:
        cross_attn = f"{block}.encoder_attn"
        kv = concat_rows("kv", "kv")
        rules += [
            *params(f"{layer}.cross_attn.q", f"{cross_attn}.q_proj"),
            *params(f"{layer}.cross_attn.kv", (f"{cross_attn}.k_proj", f"{cross_attn}.v_proj"), weight=kv, bias=kv),
            *params(f"{layer}.cross_attn.out", f"{cross_attn}.out_proj"),
            *params(f"{layer}.cross_norm", f"{block}.encoder_attn_layer_norm"),
        ]
    return rules


def bart_head() -> list[Rule]:
    """The token table (``model.shared``, which both stacks and a tied head read) and the head."""
    return [
        Rule("encoder.embed.tokens.weight", ("model.shared.weight",)),
        Rule("decoder.embed.tokens.weight", ("model.decoder.embed_tokens.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",)),
        Rule("lm_head.bias", (BIAS_KEY,), LOGITS_BIAS),
    ]


# The stacks' own copies of ``shared`` (saved when untied); tfport has one table, so they must equal it.
TOKEN_COPIES = {"model.encoder.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embed_tokens.weight": "model.shared.weight"}


def _stack(name: str, cross: bool) -> list[Rule]:
    hf = f"model.{name}"
    return bart_stack(name, hf, cross, [Rule(f"{name}.embed.positions.weight", (f"{hf}.embed_positions.weight",),
                                             POSITIONS)], norms=True)


BART = Architecture(
    model_types=("bart", "mbart"),
    classes=("BartModel", "BartForConditionalGeneration", "MBartModel", "MBartForConditionalGeneration",
             *CLASSIFIER_CLASSES),
    base_prefix="model.",
    config=_bart_config,
    rules=(*bart_head(), *_stack("encoder", cross=False), *_stack("decoder", cross=True),
           *params("classifier.dense", "classification_head.dense"),
           *params("classifier.out", "classification_head.out_proj")),
    ignored={r"model\.(encoder|decoder)\.version": "fairseq's version buffer (transformers ignores it too)"},
    duplicates=TOKEN_COPIES,
)
