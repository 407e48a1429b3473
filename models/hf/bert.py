"""BERT (``model_type`` ``bert``) -> encoder.

Post-norm LayerNorm, learned positions, token types, embedding LayerNorm; the pooler, the MLM
head (``cls.predictions.*``, decoder tied to the word embeddings) and the sequence classification
head (pooler + ``classifier``: tfport's ClassifierHead with tanh) when the file has them.
``query/key/value`` are stacked into ``qkv``. ``bert_layers`` are the encoder layers' rules that
RoBERTa, XLM-R and their relatives share.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, refuse_non_bert_encoder, token_ids
from .heads import CLASSIFIER, classifier_fields
from .rules import QKV, Architecture, Rule, params

BERT_POOLER_KEY = "bert.pooler.dense.weight"
BERT_MLM_KEY = "cls.predictions.transform.dense.weight"
# Which heads each BERT class has, when the checkpoint's keys are not at hand.
BERT_HEADS = {"BertModel": (True, False), "BertForMaskedLM": (False, True),
              "BertForPreTraining": (True, True), "BertForSequenceClassification": (True, False)}
BERT_CLASSIFIER_KEY = "classifier.weight"


def _bert_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """BERT: post-norm LayerNorm, learned positions, token types; pooler and MLM head if present."""
    refuse_non_bert_encoder(hf, "BERT")
    if keys is not None:  # the heads the file holds (a BertModel may be saved without its pooler)
        pooler, mlm = BERT_POOLER_KEY in keys, BERT_MLM_KEY in keys
        classifier = BERT_CLASSIFIER_KEY in keys
    else:
        pooler, mlm = BERT_HEADS[(hf.get("architectures") or ["BertModel"])[0]]
        classifier = (hf.get("architectures") or [""])[0] == "BertForSequenceClassification"
    if classifier:  # the pooler is the head's dense layer
        pooler = False
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="encoder", vocab_size=vocab_size, d_model=hf_field(hf, "hidden_size"),
        n_heads=hf_field(hf, "num_attention_heads"), d_ff=hf_field(hf, "intermediate_size"),
        n_encoder_layers=hf_field(hf, "num_hidden_layers"), norm="layernorm", norm_position="post",
        norm_eps=float(hf_field(hf, "layer_norm_eps", default=1e-12)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="gelu")),
        position="learned", max_positions=hf_field(hf, "max_position_embeddings", default=512),
        embedding_norm=True, type_vocab_size=hf_field(hf, "type_vocab_size", default=2),
        pooler=pooler, mlm_head=mlm, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **classifier_fields(hf, classifier), **token_ids(hf, vocab_size))


def bert_layers(layer: str) -> list[Rule]:
    """Rules of BERT-layout encoder layers: ``layer`` is the HF name of layer ``{i}``."""
    return [
        *params("encoder.layers.{i}.attn.qkv",
                tuple(f"{layer}.attention.self.{p}" for p in ("query", "key", "value")),
                weight=QKV, bias=QKV),
        *params("encoder.layers.{i}.attn.out", f"{layer}.attention.output.dense"),
        *params("encoder.layers.{i}.attn_norm", f"{layer}.attention.output.LayerNorm"),
        *params("encoder.layers.{i}.ffn.up", f"{layer}.intermediate.dense"),
        *params("encoder.layers.{i}.ffn.down", f"{layer}.output.dense"),
        *params("encoder.layers.{i}.ffn_norm", f"{layer}.output.LayerNorm"),
    ]


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
        *bert_layers(BERT_LAYER),
        *params("pooler", "bert.pooler.dense"),
        *params(f"{CLASSIFIER}.dense", "bert.pooler.dense"),
        *params(f"{CLASSIFIER}.out", "classifier"),
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
