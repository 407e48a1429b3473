"""BART and mBART sequence classification (BART-large-MNLI's zero-shot head) against
transformers' BartForSequenceClassification and MBartForSequenceClassification (tiny, random,
every parameter perturbed): the reference module's logits on right-padded batches, then the export
(``tfport export DIR`` of the checkpoint with its tokenizer.json) under the runtime on token ids,
on (premise, hypothesis) text pairs and from ``tfport classify``; then what is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tfport.config import ModelConfig
from tfport.config.classifier import ClassifierConfig
from tfport.export import ExportOptions, export_checkpoint_or_preset, export_model
from tfport.models.hf import load_hf_model
from tfport.runtime import load_model
from tfport.runtime.classify import classify_ids

from .cases import perturbed_model
from .test_bart import EOS, PAD, SIZES, Case
from .test_t5 import close

transformers = pytest.importorskip("transformers", reason="compared against transformers")

MNLI = {0: "contradiction", 1: "neutral", 2: "entailment"}  # BART-large-MNLI's id2label
LANGUAGE = "en_XX"  # mBART's tokenizer ends each text with </s> and the language code


CASES = {
    # post-norm, three named labels, pairs as <s> A </s></s> B </s> (three eos per row)
    "bart": Case("BartConfig", "BartForSequenceClassification", 31,
                 dict(id2label=MNLI, label2id={v: k for k, v in MNLI.items()})),
    # pre-norm, scaled embeddings, unnamed labels, A B </s> en_XX: the last eos is not the last token
    "mbart": Case("MBartConfig", "MBartForSequenceClassification", 32, dict(scale_embedding=True, num_labels=2)),
}

PREMISE = "w5 w9 w13 w21 w8"
HYPOTHESES = ["w40 w41", "w50 w12 w33 w7 w60 w61", "w5 w9"]  # ragged: right padding in the batch


def save_with_tokenizer(hf, case: Case, directory) -> transformers.PreTrainedTokenizerFast:
    """``save_pretrained`` plus a word-level fast tokenizer (``w5 ... w98``) with the family's
    special tokens and templates; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<s>", "<pad>", "</s>", "<unk>", LANGUAGE]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), SIZES["vocab_size"])})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    if case.config_class == "MBartConfig":
        single, pair = f"$A </s> {LANGUAGE}", f"$A $B </s> {LANGUAGE}"
    else:
        single, pair = "<s> $A </s>", "<s> $A </s> </s> $B </s>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in ("<s>", "</s>", LANGUAGE)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(directory)
    fast.save_pretrained(directory)
    return fast


@dataclass
class Built:
    name: str
    hf: torch.nn.Module
    model: torch.nn.Module
    tokenizer: object
    checkpoint: Path
    export: Path


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory):
    case = CASES[request.param]
    hf = perturbed_model(case.config_class, case.model_class, case.seed, **SIZES, **case.fields)
    checkpoint = tmp_path_factory.mktemp(request.param)
    tokenizer = save_with_tokenizer(hf, case, checkpoint)
    export = tmp_path_factory.mktemp("export") / request.param
    export_checkpoint_or_preset(str(checkpoint), export)  # validated against the imported module
    return Built(request.param, hf, load_hf_model(checkpoint), tokenizer, checkpoint, export)


def pairs_batch(tokenizer, premise: str, hypotheses: list[str]):
    encoded = tokenizer([premise] * len(hypotheses), hypotheses, padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


@torch.no_grad()
def test_config_maps_the_head(built):
    c = built.model.config
    assert (c.family, c.classifier.pooling, c.classifier.activation, c.classifier.norm) == (
        "encoder-decoder", "last_eos", "tanh", False)
    saved = json.loads((built.checkpoint / "config.json").read_text()).get("id2label")
    expected = (3, tuple(MNLI.values())) if built.name == "bart" else (2, None if saved is None else
                                                                       ("LABEL_0", "LABEL_1"))
    assert (c.classifier.n_labels, c.classifier.labels) == expected
    assert not c.lm_head_bias and c.eos_token_id == EOS
    # mBART's shift_tokens_right starts the decoder from each row's last token (its language id)
    assert c.classifier.decoder_start == ("last_token" if built.name == "mbart" else "start_token")


@torch.no_grad()
def test_module_logits_match_on_padded_batches(built):
    ids, mask = pairs_batch(built.tokenizer, PREMISE, HYPOTHESES)
    assert (mask == 0).any() and (ids[:, -1] != EOS).any()  # padded rows; mBART ends with the language
    close(built.model.classify(ids, mask), built.hf(input_ids=ids, attention_mask=mask).logits, "pairs")
    single = built.tokenizer(HYPOTHESES, padding=True, return_tensors="pt")
    close(built.model.classify(single["input_ids"], single["attention_mask"]),
          built.hf(**single).logits, "single texts")


@torch.no_grad()
def test_export_classifies_ids_like_transformers(built, tmp_path):
    """The checkpoint's export (target portable) and one for target onnx23."""
    ids, mask = pairs_batch(built.tokenizer, PREMISE, HYPOTHESES)
    expected = built.hf(input_ids=ids, attention_mask=mask).logits.numpy()
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # ragged: the runtime pads them
    export_model(built.model, tmp_path / "onnx23", ExportOptions(target="onnx23"))  # validated against the module
    for directory in (built.export, tmp_path / "onnx23"):
        out = classify_ids(load_model(directory), rows)
        np.testing.assert_allclose(out.logits, expected, rtol=1e-4, atol=1e-5, err_msg=str(directory))


@torch.no_grad()
def test_export_classifies_text_pairs_like_transformers(built):
    """Zero-shot use: one premise against several hypotheses, labels from id2label."""
    ids, mask = pairs_batch(built.tokenizer, PREMISE, HYPOTHESES)
    expected = built.hf(input_ids=ids, attention_mask=mask).logits
    out = load_model(built.export).classify(PREMISE, pairs=HYPOTHESES)
    np.testing.assert_allclose(out.logits, expected.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.scores, expected.softmax(-1).numpy(), rtol=1e-4, atol=1e-6)
    id2label = built.hf.config.id2label
    assert out.labels == [id2label[int(i)] for i in expected.argmax(-1)]
    if built.name == "bart":  # tfport classify DIR --text PREMISE --pair H ... (one process: slow)
        cli = [sys.executable, "-m", "tfport", "classify", str(built.export), "--text", PREMISE]
        for hypothesis in HYPOTHESES:
            cli += ["--pair", hypothesis]
        printed = subprocess.run(cli, capture_output=True, text=True, check=True).stdout.splitlines()
        rows = [json.loads(line) for line in printed]
        assert [row["label"] for row in rows] == out.labels
        np.testing.assert_allclose([row["logits"] for row in rows], out.logits, rtol=1e-6)


# ------------------------------------------------------------------------------------- refusals
def test_rows_without_eos_and_other_uses_are_refused(built):
    runtime = load_model(built.export)
    assert set(runtime.manifest.graphs) == {"classifier"}  # no generation graphs
    with pytest.raises(ValueError, match=rf"input_ids: rows \[1\] hold no eos_token_id={EOS}"):
        classify_ids(runtime, [[0, 5, 6, EOS], [0, 5, 6]])
    with pytest.raises(ValueError, match=rf"rows \[0\] hold no eos_token_id={EOS}"):
        built.model.classify(torch.tensor([[0, 5, 6, 7]]))
    with pytest.raises(ValueError, match=r"no decoder graph \(it has \['classifier'\]\)"):
        runtime.generate([[0, 5, EOS]])
    with pytest.raises(ValueError, match=r"no encoder graph"):
        runtime.encode([[0, 5, EOS]])


def seq2seq_config(classifier: dict | None = None, **changes) -> ModelConfig:
    """A small encoder-decoder config with ``changes``, and ``classifier`` ClassifierConfig's fields."""
    fields = dict(family="encoder-decoder", vocab_size=99, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=1,
                  n_decoder_layers=1, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=EOS)
    return ModelConfig(**{**fields, **changes}, classifier=ClassifierConfig(**(classifier or {})))


@pytest.mark.parametrize("changes, match", [
    (dict(classifier=dict(n_labels=3)), r"classifier\.pooling='cls': expected 'last_eos' for family 'encoder-decoder'"),
    (dict(classifier=dict(n_labels=3, pooling="last_eos"), eos_token_id=None),
     r"eos_token_id=None: expected a token id with classifier\.pooling='last_eos'"),
    (dict(family="encoder", n_decoder_layers=0, classifier=dict(pooling="last_eos", n_labels=2)),
     r"classifier\.pooling='last_eos': expected 'cls' or 'mean' for family 'encoder'"),
    (dict(family="decoder", n_encoder_layers=0, classifier=dict(n_labels=2)),
     r"classifier\.n_labels=2: expected 0 unless family is 'encoder' or 'encoder-decoder'"),
    (dict(classifier=dict(decoder_start="last_token")),
     r"classifier\.decoder_start='last_token': expected 'start_token' unless an encoder-decoder has a "
     r"classification head"),
    (dict(classifier=dict(n_labels=2, pooling="last_eos", decoder_start="first_token")),
     r"classifier\.decoder_start='first_token': expected one of \['start_token', 'last_token'\]"),
])
def test_config_refuses_other_classifier_layouts(changes, match):
    with pytest.raises(ValueError, match=match):
        seq2seq_config(**changes)
    assert seq2seq_config(classifier=dict(n_labels=3, pooling="last_eos")).classifier.n_labels == 3
