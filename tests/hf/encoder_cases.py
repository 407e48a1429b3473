"""Tiny Hugging Face encoders with heads (issue 13): RoBERTa, XLM-R, CamemBERT, BERT and
DistilBERT, masked-LM and sequence classification (classifiers, rerankers), built offline with
every parameter perturbed (see ``cases``), and a word-level tokenizer in the family's layout for
the text and sentence-transformers tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cases import perturbed_model

VOCAB = 96
# RoBERTa's special ids: <s> 0, <pad> 1 (the position tables' padding_idx), </s> 2.
ROBERTA_IDS = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2)
BERT_IDS = dict(bos_token_id=1, pad_token_id=0, eos_token_id=2)
SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)


@dataclass(frozen=True)
class EncoderCase:
    name: str
    model_class: str
    config_class: str
    fields: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def pad(self) -> int:
        return self.fields.get("pad_token_id", 0)


CASES = {case.name: case for case in [
    EncoderCase("roberta-mlm", "RobertaForMaskedLM", "RobertaConfig", dict(
        **SIZE, **ROBERTA_IDS, max_position_embeddings=66, type_vocab_size=1), seed=20),
    EncoderCase("camembert-mlm", "CamembertForMaskedLM", "CamembertConfig", dict(
        **SIZE, **ROBERTA_IDS, max_position_embeddings=66, type_vocab_size=1), seed=26),
    EncoderCase("xlmr-classifier", "XLMRobertaForSequenceClassification", "XLMRobertaConfig", dict(
        **SIZE, **ROBERTA_IDS, max_position_embeddings=66, type_vocab_size=1,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
        label2id={"negative": 0, "neutral": 1, "positive": 2}), seed=21),
    EncoderCase("roberta-reranker", "RobertaForSequenceClassification", "RobertaConfig", dict(
        **SIZE, **ROBERTA_IDS, max_position_embeddings=66, type_vocab_size=1, num_labels=1), seed=22),
    EncoderCase("bert-classifier", "BertForSequenceClassification", "BertConfig", dict(
        **SIZE, **BERT_IDS, max_position_embeddings=64, num_labels=2), seed=23),
    EncoderCase("distilbert-mlm", "DistilBertForMaskedLM", "DistilBertConfig", dict(
        dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=64, pad_token_id=0), seed=24),
    EncoderCase("distilbert-classifier", "DistilBertForSequenceClassification", "DistilBertConfig", dict(
        dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=64, pad_token_id=0,
        id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1}), seed=25),
]}


def build(case: EncoderCase):
    """The case's transformers model (eager attention, eval mode), every parameter perturbed."""
    return perturbed_model(case.config_class, case.model_class, case.seed, vocab_size=VOCAB,
                           initializer_range=0.1, **case.fields)


def batch(case: EncoderCase, padding: str, seed: int, length: int = 7, pad: int = 3):
    """input_ids, attention_mask [2, length]; row 0 padded by ``pad`` slots with the pad id."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    if padding == "left":
        mask[0, :pad] = 0
    else:
        mask[0, length - pad:] = 0
    return ids.masked_fill(mask == 0, case.pad), mask


def save_with_tokenizer(model, case: EncoderCase, directory: Path) -> Path:
    """``save_pretrained`` plus a word-level fast tokenizer (``w4 ... w95``) whose special tokens and
    pair template follow the family (RoBERTa ``<s> A </s></s> B </s>``, BERT ``[CLS] A [SEP] B
    [SEP]`` with token types 0 / 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    roberta = case.pad == 1
    limit = getattr(model.config, "max_position_embeddings")
    specials = ["<s>", "<pad>", "</s>", "<unk>"] if roberta else ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials[3]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    start, end = (specials[0], specials[2]) if roberta else (specials[1], specials[2])
    pair = f"{start} $A {end} {end} $B {end}" if roberta else f"{start} $A {end} $B:1 {end}:1"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{start} $A {end}", pair=pair,
        special_tokens=[(start, vocab[start]), (end, vocab[end])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_max_length=limit - (2 if roberta else 0),
        pad_token=specials[0 if not roberta else 1], unk_token=specials[3],
        cls_token=start, sep_token=end, bos_token=start, eos_token=end)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def imports(cases: dict[str, EncoderCase], tmp_path_factory):
    """``get(name)`` -> (case, transformers model, saved directory, tfport module), built once per
    name: the body of each test module's fixture."""
    from tfport.models.hf import load_hf_model

    cache = {}

    def get(name: str):
        if name not in cache:
            case = cases[name]
            hf = build(case)
            directory = save_with_tokenizer(hf, case, tmp_path_factory.mktemp(name))
            cache[name] = (case, hf, directory, load_hf_model(directory))
        return cache[name]

    return get
