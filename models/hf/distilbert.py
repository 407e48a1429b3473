"""DistilBERT (``model_type`` ``distilbert``) -> encoder.

BERT's computation (post-norm LayerNorm, learned positions counted 0..S-1, embedding LayerNorm)
without token types, in its own key layout: ``distilbert.transformer.layer.{i}`` with
``attention.{q,k,v,out}_lin``, ``sa_layer_norm``, ``ffn.lin1/lin2``, ``output_layer_norm``. Heads:
MLM (``vocab_transform`` -> activation -> ``vocab_layer_norm`` -> ``vocab_projector``, tied) and
sequence classification (``pre_classifier`` -> ReLU -> ``classifier`` on the first token:
tfport's ClassifierHead with relu); DistilBERT has no pooler.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, token_ids
from .heads import CLASSIFIER, MLM, classifier_fields, present_heads
from .rules import QKV, Architecture, Rule, params

HEAD_KEYS = {MLM: "vocab_transform.weight", CLASSIFIER: "pre_classifier.weight"}
CLASSES = {"DistilBertModel": (), "DistilBertForMaskedLM": (MLM,),
           "DistilBertForSequenceClassification": (CLASSIFIER,)}


def _distilbert_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    heads = present_heads(hf, keys, HEAD_KEYS, CLASSES, "DistilBertModel")
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="encoder", vocab_size=vocab_size, d_model=hf_field(hf, "dim"),
        n_heads=hf_field(hf, "n_heads"), d_ff=hf_field(hf, "hidden_dim"),
        n_encoder_layers=hf_field(hf, "n_layers"), norm="layernorm", norm_position="post",
        norm_eps=1e-12,  # DistilBERT's LayerNorms are built with eps=1e-12, not from the config
        activation=hf_activation(hf, hf_field(hf, "activation", default="gelu")),
        position="learned", max_positions=hf_field(hf, "max_position_embeddings", default=512),
        embedding_norm=True, mlm_head=MLM in heads,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **classifier_fields(hf, CLASSIFIER in heads, activation="relu"), **token_ids(hf, vocab_size))


LAYER = "distilbert.transformer.layer.{i}"
DISTILBERT = Architecture(
    model_types=("distilbert",),
    classes=tuple(CLASSES),
    base_prefix="distilbert.",
    config=_distilbert_config,
    rules=(
        Rule("encoder.embed.tokens.weight", ("distilbert.embeddings.word_embeddings.weight",)),
        Rule("encoder.embed.positions.weight", ("distilbert.embeddings.position_embeddings.weight",)),
        *params("encoder.embed.norm", "distilbert.embeddings.LayerNorm"),
        *params("encoder.layers.{i}.attn.qkv", tuple(f"{LAYER}.attention.{p}_lin" for p in "qkv"),
                weight=QKV, bias=QKV),
        *params("encoder.layers.{i}.attn.out", f"{LAYER}.attention.out_lin"),
        *params("encoder.layers.{i}.attn_norm", f"{LAYER}.sa_layer_norm"),
        *params("encoder.layers.{i}.ffn.up", f"{LAYER}.ffn.lin1"),
        *params("encoder.layers.{i}.ffn.down", f"{LAYER}.ffn.lin2"),
        *params("encoder.layers.{i}.ffn_norm", f"{LAYER}.output_layer_norm"),
        *params("mlm.dense", "vocab_transform"),
        *params("mlm.norm", "vocab_layer_norm"),
        *params("mlm.decoder", "vocab_projector"),
        *params(f"{CLASSIFIER}.dense", "pre_classifier"),
        *params(f"{CLASSIFIER}.out", "classifier"),
    ),
    ignored={r"distilbert\.embeddings\.position_ids": "a buffer; tfport counts positions from "
             "attention_mask"},
)
