"""RoBERTa, XLM-RoBERTa and CamemBERT (``model_type`` ``roberta``, ``xlm-roberta``, ``camembert``)
-> encoder.

BERT's layout under ``roberta.``, with two differences in the embeddings. Positions start after
the padding index: real token k (k = 0, 1, ...) reads row ``padding_idx + 1 + k`` of the table
(transformers counts ``cumsum(input_ids != padding_idx) + padding_idx``), so tfport keeps the rows
from ``padding_idx + 1`` on and counts positions from 0 as for every model; ``max_positions`` is
what is left (514 - 2 = 512). Token types are optional: with the usual single type
(``type_vocab_size`` 1) its one row is added to every position row, so the graph takes no
``token_type_ids``. Heads: pooler, MLM (``lm_head.*``: dense, GELU, LayerNorm, tied decoder) and
sequence classification (``classifier.dense`` + tanh + ``classifier.out_proj`` on the first
token: tfport's ClassifierHead) when the file has them.
"""

from __future__ import annotations

import torch

from tfport.config import ModelConfig

from .bert import bert_layers
from .configs import hf_activation, hf_field, refuse, refuse_non_bert_encoder, token_ids
from .heads import CLASSIFIER, MLM, POOLER, classifier_fields, present_heads
from .rules import Architecture, Rule, Transform, params

HEAD_KEYS = {POOLER: "roberta.pooler.dense.weight", MLM: "lm_head.dense.weight",
             CLASSIFIER: "classifier.out_proj.weight"}
CLASSES = {}
for _family in ("Roberta", "XLMRoberta", "Camembert"):
    CLASSES.update({f"{_family}Model": (POOLER,), f"{_family}ForMaskedLM": (MLM,),
                    f"{_family}ForSequenceClassification": (CLASSIFIER,)})


def _offset(config: ModelConfig) -> int:
    """Table rows before position 0: padding_idx + 1 (padding_idx is the pad id)."""
    return config.pad_token_id + 1


def _positions(ts: list[torch.Tensor], shape, config: ModelConfig) -> torch.Tensor:
    table = ts[0][_offset(config):]  # [max_positions, E]
    return table + ts[1][0] if len(ts) == 2 else table  # the single token type folded in


POSITIONS = Transform("rows after padding_idx", lambda shape, c: [(shape[0] + _offset(c), shape[1])],
                      _positions)
POSITIONS_AND_TYPE = Transform("rows after padding_idx + the single token type row",
                               lambda shape, c: [(shape[0] + _offset(c), shape[1]), (1, shape[1])],
                               _positions)


def _roberta_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """RoBERTa: BERT with positions after padding_idx and at most a single token type folded in."""
    refuse_non_bert_encoder(hf, "RoBERTa")
    heads = present_heads(hf, keys, HEAD_KEYS, CLASSES, "RobertaModel")
    vocab_size = hf_field(hf, "vocab_size")
    ids = token_ids(hf, vocab_size)
    ids["pad_token_id"] = hf_field(hf, "pad_token_id", default=1)  # padding_idx of the tables
    positions = hf_field(hf, "max_position_embeddings", default=514) - ids["pad_token_id"] - 1
    types = hf_field(hf, "type_vocab_size", default=1)
    activation = hf_field(hf, "hidden_act", default="gelu")
    if MLM in heads and activation != "gelu":
        refuse(hf, "hidden_act", activation, "RoBERTa's masked-LM head applies GELU whatever hidden_act "
               "says, and tfport's head applies the model's activation")
    return ModelConfig(
        family="encoder", vocab_size=vocab_size, d_model=hf_field(hf, "hidden_size"),
        n_heads=hf_field(hf, "num_attention_heads"), d_ff=hf_field(hf, "intermediate_size"),
        n_encoder_layers=hf_field(hf, "num_hidden_layers"), norm="layernorm", norm_position="post",
        norm_eps=float(hf_field(hf, "layer_norm_eps", default=1e-5)),
        activation=hf_activation(hf, activation),
        position="learned", max_positions=positions, embedding_norm=True,
        type_vocab_size=types if types > 1 else 0, pooler=POOLER in heads, mlm_head=MLM in heads,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **classifier_fields(hf, CLASSIFIER in heads), **ids)


EMB = "roberta.embeddings"
ROBERTA = Architecture(
    model_types=("roberta", "xlm-roberta", "camembert"),
    classes=tuple(CLASSES),
    base_prefix="roberta.",
    config=_roberta_config,
    rules=(
        Rule("encoder.embed.tokens.weight", (f"{EMB}.word_embeddings.weight",)),
        Rule("encoder.embed.positions.weight",
             (f"{EMB}.position_embeddings.weight", f"{EMB}.token_type_embeddings.weight"),
             POSITIONS_AND_TYPE, when=lambda c: c.type_vocab_size == 0),
        Rule("encoder.embed.positions.weight", (f"{EMB}.position_embeddings.weight",), POSITIONS),
        Rule("encoder.embed.token_types.weight", (f"{EMB}.token_type_embeddings.weight",)),
        *params("encoder.embed.norm", f"{EMB}.LayerNorm"),
        *bert_layers("roberta.encoder.layer.{i}"),
        *params("pooler", "roberta.pooler.dense"),
        *params("mlm.dense", "lm_head.dense"),
        *params("mlm.norm", "lm_head.layer_norm"),
        Rule("mlm.decoder.weight", ("lm_head.decoder.weight",)),
        Rule("mlm.decoder.bias", ("lm_head.bias",)),
        *params(f"{CLASSIFIER}.dense", "classifier.dense"),
        *params(f"{CLASSIFIER}.out", "classifier.out_proj"),
    ),
    ignored={r"roberta\.embeddings\.(position_ids|token_type_ids)": "buffers; tfport counts positions "
             "from attention_mask"},
    duplicates={"lm_head.decoder.bias": "lm_head.bias"},
)
