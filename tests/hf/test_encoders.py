"""Encoders with heads imported from transformers (RoBERTa, XLM-R, BERT classification; issue
13): the tfport module and its ONNX export under the runtime give transformers' states, MLM logits
and classification logits on padded batches; a reranker scores text pairs as sentence-transformers'
CrossEncoder does; ``tfport classify`` prints the labels.

RoBERTa's positions: transformers counts them from ``input_ids != padding_idx``, tfport from the
attention mask; with the pad id in padded slots both agree, left padding included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from .cases import TOLERANCE
from .encoder_cases import CASES, batch, imports

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``imported(name)`` -> (case, transformers model, saved directory, tfport module), cached."""
    return imports(CASES, tmp_path_factory)


def close(actual, expected, what: str, real=None) -> None:
    actual, expected = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x) for x in (actual, expected))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if real is not None:
        actual, expected = actual[real], expected[real]
    np.testing.assert_allclose(actual, expected, rtol=TOLERANCE[0], atol=TOLERANCE[1], err_msg=what)


def hf_outputs(hf, ids, mask) -> dict:
    with torch.no_grad():
        states = hf.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        head = hf(input_ids=ids, attention_mask=mask).logits
    return {"last_hidden_state": states, "head": head}


# Left padding only where transformers counts positions over real tokens (RoBERTa's family); BERT
# counts 0..S-1 whatever the padding (tests/hf/test_parity gives it tfport's positions instead).
PADDINGS = [(name, padding) for name in sorted(CASES) for padding in ("right", "left")
            if padding == "right" or CASES[name].pad == 1]


@pytest.mark.parametrize("name, padding", PADDINGS)
def test_module_matches_transformers(imported, name, padding):
    case, hf, _, model = imported(name)
    ids, mask = batch(case, padding, seed=31)
    with torch.no_grad():
        out = model(ids, mask)
    expected = hf_outputs(hf, ids, mask)
    real = mask.bool().numpy()
    close(out.last_hidden_state, expected["last_hidden_state"], f"{name} states", real)
    if model.config.mlm_head:
        close(out.logits, expected["head"], f"{name} mlm logits", real)
    if model.config.classifier.n_labels and padding == "right":  # the head reads the first token
        close(out.class_logits, expected["head"], f"{name} class logits")


def test_configs(imported):
    _, _, _, xlmr = imported("xlmr-classifier")
    config = xlmr.config
    assert (config.classifier.n_labels, config.classifier.labels) == (3, ("negative", "neutral", "positive"))
    assert config.type_vocab_size == 0 and config.max_positions == 64 and config.pad_token_id == 1
    assert not config.pooler and not config.mlm_head
    assert imported("roberta-reranker")[3].config.classifier.n_labels == 1
    bert = imported("bert-classifier")[3].config
    assert bert.classifier.n_labels == 2 and not bert.pooler and bert.type_vocab_size == 2
    distil = imported("distilbert-classifier")[3].config
    head = distil.classifier
    assert (head.n_labels, head.labels, head.activation) == (2, ("no", "yes"), "relu")
    assert distil.type_vocab_size == 0 and not distil.pooler


@pytest.mark.parametrize("name", ["xlmr-classifier", "bert-classifier", "roberta-mlm", "distilbert-classifier"])
def test_export_runtime_matches_transformers(imported, tmp_path, name):
    """The export of the directory (tokenizer.json shipped) under the runtime: encode and
    classify on token ids and on text."""
    from tfport.export import export_checkpoint_or_preset
    from tfport.runtime import load_model

    case, hf, directory, _ = imported(name)
    export_checkpoint_or_preset(str(directory), tmp_path / "export")
    model = load_model(tmp_path / "export", "cpu")
    ids, mask = batch(case, "right", seed=32)
    expected = hf_outputs(hf, ids, mask)
    out = model.encode(ids.numpy(), mask.numpy())
    close(out.last_hidden_state, expected["last_hidden_state"], f"{name} onnx states", mask.bool().numpy())
    if not model.config.classifier.n_labels:
        close(out.logits, expected["head"], f"{name} onnx mlm logits", mask.bool().numpy())
        with pytest.raises(ValueError, match="no sequence classification head"):
            model.classify("w5 w6")
        return
    close(out.class_logits, expected["head"], f"{name} onnx class logits")
    texts, pairs = ["w5 w9 w17", "w40 w41"], ["w7 w8", "w90 w91 w92 w93"]
    result = model.classify(texts, pairs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    encoded = tokenizer(texts, pairs, padding=True, return_tensors="pt",
                        return_token_type_ids=model.config.type_vocab_size > 0)
    with torch.no_grad():
        logits = hf(**encoded).logits
    close(result.logits, logits, f"{name} classify(texts, pairs)")
    names = [hf.config.id2label[i] for i in logits.argmax(-1).tolist()]
    assert result.labels == names
    np.testing.assert_allclose(result.scores, torch.softmax(logits, -1).numpy(), rtol=1e-4, atol=1e-6)


def test_reranker_matches_cross_encoder(imported, tmp_path, capsys, caplog):
    """A one-logit head: scores are the sigmoid CrossEncoder.predict applies; long pairs are
    truncated (longest first) to the model's 64 positions, as the tokenizer truncates them."""
    st = pytest.importorskip("sentence_transformers")
    from tfport.cli import main
    from tfport.export import export_checkpoint_or_preset
    from tfport.runtime import load_model

    _, _, directory, _ = imported("roberta-reranker")
    export_checkpoint_or_preset(str(directory), tmp_path / "export")
    model = load_model(tmp_path / "export", "cpu")
    query = "w5 w6 w7"
    passages = ["w8 w9 w10 w11", "w50 w60", " ".join(f"w{4 + i % 90}" for i in range(100))]
    cross = st.CrossEncoder(str(directory), device="cpu")
    expected = cross.predict([(query, p) for p in passages])
    with caplog.at_level("WARNING"):
        got = model.classify(query, pairs=passages)
    assert "1 of 3 input(s) (index [2])" in caplog.text
    np.testing.assert_allclose(got.scores[:, 0], expected, rtol=1e-4, atol=1e-6)
    assert main(["classify", str(tmp_path / "export"), "--text", query, "--pair", passages[0]]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["label"] == "LABEL_0" and row["scores"][0] == pytest.approx(float(expected[0]), abs=1e-5)
