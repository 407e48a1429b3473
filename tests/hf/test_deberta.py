"""DeBERTa-v3 (``deberta-v2``) imported from transformers: the tfport module and its export
(targets portable and onnx23) under the runtime give transformers' states, MLM logits and
classification logits on padded batches; other DeBERTa variants are refused by field.

Sequences of 20 tokens with 8 buckets and a max distance of 16 cover the exact relative
positions (|i - j| <= 4), the logarithmic buckets and the clipped ends. Left padding matches too:
transformers numbers relative positions by slot, and so does tfport.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfport.models.hf import hf_config_to_tfport

from .cases import TOLERANCE
from .encoder_cases import EncoderCase, batch, imports

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")

# DeBERTa-v3's form (microsoft/deberta-v3-*), at a tiny size; [PAD] 0, [CLS] 1, [SEP] 2 as v3.
V3 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
          max_position_embeddings=64, relative_attention=True, pos_att_type="p2c|c2p",
          position_biased_input=False, share_att_key=True, norm_rel_ebd="layer_norm",
          position_buckets=8, max_relative_positions=16, type_vocab_size=0, layer_norm_eps=1e-7,
          pad_token_id=0, bos_token_id=1, eos_token_id=2)
LENGTH, PAD = 20, 6  # row 0 of each batch has PAD padded slots
CASES = {case.name: case for case in [
    EncoderCase("v3-model", "DebertaV2Model", "DebertaV2Config", V3, seed=40),
    EncoderCase("v3-mlm", "DebertaV2ForMaskedLM", "DebertaV2Config", V3, seed=41),
    EncoderCase("v3-mlm-lm-predictions", "DebertaV2ForMaskedLM", "DebertaV2Config",
                dict(V3, legacy=False), seed=42),
    EncoderCase("v3-classifier", "DebertaV2ForSequenceClassification", "DebertaV2Config", dict(
        V3, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2}), seed=43),
    # One term, unbucketed relative positions clipped at +-6, token types, a tanh pooler.
    EncoderCase("c2p-clipped-types", "DebertaV2ForSequenceClassification", "DebertaV2Config", dict(
        V3, pos_att_type=["c2p"], position_buckets=-1, max_relative_positions=6, type_vocab_size=2,
        pooler_hidden_act="tanh", num_labels=1), seed=44),
    EncoderCase("p2c-default-distance", "DebertaV2ForMaskedLM", "DebertaV2Config", dict(
        V3, pos_att_type="p2c", max_relative_positions=-1, max_position_embeddings=20), seed=45),
]}


@pytest.fixture(scope="module")
def deberta(tmp_path_factory):
    """``deberta(name)`` -> (case, transformers model, saved directory, tfport module), cached."""
    return imports(CASES, tmp_path_factory)


def inputs(case: EncoderCase, padding: str, seed: int) -> dict[str, torch.Tensor]:
    ids, mask = batch(case, padding, seed, length=LENGTH, pad=PAD)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if case.fields.get("type_vocab_size"):
        generator = torch.Generator().manual_seed(seed + 1)
        feeds["token_type_ids"] = torch.randint(0, 2, ids.shape, generator=generator) * mask
    return feeds


def reference(hf, feeds: dict) -> dict[str, torch.Tensor]:
    """transformers' states and head output (MLM or class logits) for ``feeds``."""
    with torch.no_grad():
        out = {"states": hf.base_model(**feeds).last_hidden_state}
        if hf.base_model is not hf:  # a task model
            out["head"] = hf(**feeds).logits
        return out


def close(actual, expected, what: str) -> None:
    actual, expected = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x) for x in (actual, expected))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, rtol=TOLERANCE[0], atol=TOLERANCE[1], err_msg=what)


def real_rows(values, mask) -> list[np.ndarray]:
    """Each row's values at its real tokens (so left- and right-padded layouts compare)."""
    values, mask = np.asarray(values), np.asarray(mask).astype(bool)
    return [v[m] for v, m in zip(values, mask)]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_module_matches_transformers(deberta, name, padding):
    case, hf, _, model = deberta(name)
    feeds = inputs(case, padding, seed=51)
    expected = reference(hf, feeds)
    with torch.no_grad():
        out = model(**feeds)
    real = feeds["attention_mask"].bool()
    close(out.last_hidden_state[real], expected["states"][real], f"{name} states")
    if model.config.mlm_head:
        close(out.logits[real], expected["head"][real], f"{name} mlm logits")
    if model.config.classifier.n_labels and padding == "right":  # the head reads the first token
        close(out.class_logits, expected["head"], f"{name} class logits")


def test_configs(deberta):
    config = deberta("v3-classifier")[3].config
    assert (config.position, config.disentangled.buckets, config.disentangled.max_distance) == (
        "disentangled", 8, 16)
    assert config.disentangled.effective_terms == ("c2p", "p2c")
    assert config.softmax_scale == pytest.approx((8 * 3) ** -0.5)
    head = config.classifier
    assert (head.n_labels, head.labels, head.activation) == (3, ("a", "b", "c"), "gelu")
    assert config.norm_position == "post" and config.embedding_norm and not config.pooler
    clipped = deberta("c2p-clipped-types")[3].config
    part = clipped.disentangled
    assert (part.buckets, part.max_distance, part.effective_terms) == (None, 6, ("c2p",))
    assert (clipped.type_vocab_size, clipped.classifier.activation, clipped.classifier.n_labels) == (2, "tanh", 1)
    default = deberta("p2c-default-distance")[3].config  # max_relative_positions -1: the table size
    assert (default.disentangled.max_distance, default.disentangled.effective_terms) == (20, ("p2c",))
    assert default.mlm_head and default.tie_embeddings


EXPORTS = [("v3-mlm", "portable"), ("v3-classifier", "portable"), ("v3-mlm-lm-predictions", "onnx23"),
           ("c2p-clipped-types", "onnx23")]


@pytest.mark.parametrize("name, target", EXPORTS)
def test_export_runtime_matches_transformers(deberta, tmp_path, name, target):
    """The export of the directory (validated against the module on left/right-padded cases by
    export itself) under the runtime: encode on both paddings, classify on text."""
    from tfport.export import ExportOptions, export_checkpoint_or_preset
    from tfport.runtime import load_model

    case, hf, directory, _ = deberta(name)
    export_checkpoint_or_preset(str(directory), tmp_path / "export", ExportOptions(target=target))
    model = load_model(tmp_path / "export", "cpu")
    for padding in ("right", "left"):
        feeds = inputs(case, padding, seed=52)
        expected = reference(hf, feeds)
        out = model.encode(**{k: v.numpy() for k, v in feeds.items()})  # rows come back right-padded
        mask = feeds["attention_mask"].numpy()
        for row, (got, want) in enumerate(zip(real_rows(out.last_hidden_state, out.attention_mask),
                                              real_rows(expected["states"], mask))):
            close(got, want, f"{name} {target} {padding} states row {row}")
        if model.config.mlm_head:
            for row, (got, want) in enumerate(zip(real_rows(out.logits, out.attention_mask),
                                                  real_rows(expected["head"], mask))):
                close(got, want, f"{name} {target} {padding} mlm logits row {row}")
        elif padding == "right":
            close(out.class_logits, expected["head"], f"{name} {target} class logits")
    if model.config.classifier.n_labels:
        texts, pairs = ["w5 w9 w17 w30 w31 w32 w33", "w40 w41"], ["w7 w8", "w90 w91 w92 w93 w60 w61"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        encoded = tokenizer(texts, pairs, padding=True, return_tensors="pt",
                            return_token_type_ids=model.config.type_vocab_size > 0)
        with torch.no_grad():
            logits = hf(**encoded).logits
        close(model.classify(texts, pairs).logits, logits, f"{name} {target} classify(texts, pairs)")


def test_ort_target_refuses(deberta, tmp_path):
    from tfport.export import ExportOptions, export_model

    with pytest.raises(ValueError, match="target='ort'.*family='encoder'"):
        export_model(deberta("v3-model")[3], tmp_path / "ort", ExportOptions(target="ort"))


REFUSED = [  # (changed config.json fields, the field the error names)
    (dict(conv_kernel_size=3), "conv_kernel_size"),  # DeBERTa-v2 xlarge
    (dict(position_biased_input=True), "position_biased_input"),
    (dict(share_att_key=False), "share_att_key"),
    (dict(relative_attention=False), "relative_attention"),
    (dict(norm_rel_ebd="none"), "norm_rel_ebd"),
    (dict(embedding_size=16), "embedding_size"),
    (dict(pooler_hidden_size=16), "pooler_hidden_size"),
    (dict(pos_att_type=["c2p", "p2p"]), "pos_att_type"),
    (dict(pos_att_type=[]), "pos_att_type"),
    (dict(position_buckets=7), "position_buckets"),
    (dict(pooler_hidden_act="mish"), "activation"),
]


@pytest.mark.parametrize("changes, field", REFUSED, ids=[f for _, f in REFUSED])
def test_refuses_other_variants(changes, field):
    hf = dict(V3, model_type="deberta-v2", vocab_size=96, architectures=["DebertaV2ForSequenceClassification"])
    with pytest.raises(ValueError, match=rf"{field}=.*model_type='deberta-v2'"):
        hf_config_to_tfport({**hf, **changes})
