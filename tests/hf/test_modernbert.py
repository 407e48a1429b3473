"""ModernBERT imported from transformers: the tfport module and its export (targets portable and
onnx23) under the runtime give transformers' states, MLM logits and classification logits on
padded batches longer than the local window, so local (two-sided window, own RoPE base) and
global layers differ; the two-sided window of ``ai.tfport.AttentionBias`` equals the reference
mask; what tfport cannot compute is refused by field and value.

transformers numbers positions by slot; for left padding it is given tfport's positions (counted
from the mask), with which its slot-measured windows agree (see models/hf/modernbert.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tfport.config.window import WindowConfig
from tfport.models import build_model
from tfport.models.hf import hf_config_to_tfport, load_hf_model
from tfport.models.masks import attention_bias
from tfport.models.positions import positions_from_mask

from .cases import TOLERANCE, perturbed_model
from .encoder_cases import save_with_tokenizer

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")

VOCAB, LENGTH = 96, 12  # 12 tokens: well past every case's window
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
SIZE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=64, initializer_range=0.1, **IDS)


@dataclass(frozen=True)
class Case:
    name: str
    model_class: str
    fields: dict = field(default_factory=dict)
    seed: int = 0
    # Rewrite config.json as pre-transformers-5 checkpoints ship it: global_attn_every_n_layers,
    # global_rope_theta, local_rope_theta instead of layer_types and rope_parameters.
    legacy: bool = False


CASES = {case.name: case for case in [
    # Defaults: no biases, layers 0 and 3 global, 1 and 2 local (+-2 tokens), local base 100.
    Case("mlm", "ModernBertForMaskedLM", dict(local_attention=4, local_rope_theta=100.0), seed=40),
    # Every optional bias, an odd window (+-2), every other layer global, mean pooling, tanh head,
    # GeGLU in its tanh form; config.json in the legacy layout.
    Case("classifier-biased", "ModernBertForSequenceClassification", dict(
        local_attention=5, global_attn_every_n_layers=2, norm_bias=True, attention_bias=True,
        mlp_bias=True, classifier_bias=True, decoder_bias=False, classifier_pooling="mean",
        classifier_activation="tanh", hidden_activation="gelu_pytorch_tanh", num_labels=3,
        global_rope_theta=1000.0, local_rope_theta=50.0), seed=41, legacy=True),
    # The first token's state through a window of +-3, named labels, untied embeddings.
    Case("classifier-cls", "ModernBertForSequenceClassification", dict(
        local_attention=6, id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1},
        tie_word_embeddings=False), seed=42),
]}


def _legacy(directory) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    types, rope = config.pop("layer_types"), config.pop("rope_parameters")
    every = types.index("full_attention", 1)  # layers 0, every, 2 every ... are global
    assert types == ["sliding_attention" if i % every else "full_attention" for i in range(len(types))]
    config.update(global_attn_every_n_layers=every, global_rope_theta=rope["full_attention"]["rope_theta"],
                  local_rope_theta=rope["sliding_attention"]["rope_theta"])
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``imported(name)`` -> (case, transformers model, saved directory, tfport module), cached."""
    cache = {}

    def get(name: str):
        if name not in cache:
            case = CASES[name]
            hf = perturbed_model("ModernBertConfig", case.model_class, case.seed, **SIZE, **case.fields)
            directory = save_with_tokenizer(hf, _TokenizerCase(), tmp_path_factory.mktemp(name))
            if case.legacy:
                _legacy(directory)
            cache[name] = (case, hf, directory, load_hf_model(directory))
        return cache[name]

    return get


@dataclass(frozen=True)
class _TokenizerCase:
    """BERT-style specials for encoder_cases.save_with_tokenizer: [PAD] 0, [CLS] 1, [SEP] 2."""

    pad: int = 0


def batch(padding: str, seed: int):
    """input_ids, attention_mask [2, LENGTH]; row 0 has 4 padded slots."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (2, LENGTH), generator=generator)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if padding == "left":
        mask[0, :4] = 0
    else:
        mask[0, LENGTH - 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_outputs(hf, ids, mask) -> dict:
    positions = positions_from_mask(mask, ids.shape[1])
    with torch.no_grad():
        states = hf.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        head = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return {"states": states, "head": head}


def close(actual, expected, what: str, real=None) -> None:
    actual, expected = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x) for x in (actual, expected))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if real is not None:
        actual, expected = actual[real], expected[real]
    np.testing.assert_allclose(actual, expected, rtol=TOLERANCE[0], atol=TOLERANCE[1], err_msg=what)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_module_matches_transformers(imported, name, padding):
    case, hf, _, model = imported(name)
    ids, mask = batch(padding, seed=50)
    with torch.no_grad():
        out = model(ids, mask)
    expected = hf_outputs(hf, ids, mask)
    real = mask.bool().numpy()
    close(out.last_hidden_state, expected["states"], f"{name} states", real)
    if model.config.mlm_head:
        close(out.logits, expected["head"], f"{name} mlm logits", real)
    elif padding == "right" or model.config.classifier.pooling == "mean":  # cls reads slot 0
        close(out.class_logits, expected["head"], f"{name} class logits")


def test_configs(imported):
    mlm = imported("mlm")[3].config
    assert (mlm.window.size, mlm.window.layers, mlm.rope.theta, mlm.rope.local_theta) == (4, (1, 2), 160000.0, 100.0)
    assert mlm.mlm_head and not mlm.first_attn_norm and mlm.gated_ffn and not mlm.attention_bias
    biased = imported("classifier-biased")[3].config  # read from the legacy layout
    assert (biased.window.size, biased.window.layers, biased.rope.theta, biased.rope.local_theta) == \
        (5, (1, 3), 1000.0, 50.0)
    head = biased.classifier
    assert (head.n_labels, head.pooling, head.activation, biased.activation) == \
        (3, "mean", "tanh", "gelu_tanh")
    cls = imported("classifier-cls")[3].config
    assert (cls.classifier.labels, cls.classifier.norm, cls.tie_embeddings) == (("no", "yes"), True, False)


def test_window_and_local_base_matter(imported):
    """Without the window and the local RoPE base the module no longer matches: the cases test them."""
    _, hf, _, model = imported("mlm")
    ids, mask = batch("right", seed=51)
    plain = build_model(model.config.replace(window=WindowConfig(), rope=model.config.rope.replace(local_theta=None)))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        gap = (plain(ids, mask).last_hidden_state - hf_outputs(hf, ids, mask)["states"]).abs()
    assert gap[mask.bool()].max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_attention_bias_function_matches_reference(causal):
    """``ai.tfport.AttentionBias`` (run eagerly on ONNX Runtime) against ``attention_bias``,
    padded rows, every window width from none to past the row."""
    from tfport.export.functions import AttentionBias

    mask = np.ones((3, 9), dtype=np.int64)
    mask[0, :3], mask[1, 6:] = 0, 0
    for window in (0, 1, 2, 4, 5, 10):  # none, the query alone, +-1, +-2 (even and odd W), all
        got = AttentionBias(mask, np.array([9], dtype=np.int64), causal=int(causal), window=window)
        ref = attention_bias(torch.tensor(mask), 9, causal, window or None)
        np.testing.assert_array_equal(np.asarray(got), ref.numpy(), err_msg=f"window {window}")


@pytest.mark.parametrize("target", ["portable", "onnx23"])
@pytest.mark.parametrize("name", ["mlm", "classifier-biased"])
def test_export_runtime_matches_transformers(imported, tmp_path, name, target):
    from tfport.export import ExportOptions, export_model
    from tfport.runtime import load_model

    _, hf, _, module = imported(name)
    export_model(module, tmp_path / "export", ExportOptions(target=target))
    model = load_model(tmp_path / "export", "cpu")
    ids, mask = batch("right", seed=52)
    expected = hf_outputs(hf, ids, mask)
    out = model.encode(ids.numpy(), mask.numpy())
    real = mask.bool().numpy()
    close(out.last_hidden_state, expected["states"], f"{name} {target} states", real)
    if module.config.mlm_head:
        close(out.logits, expected["head"], f"{name} {target} mlm logits", real)
    else:
        close(out.class_logits, expected["head"], f"{name} {target} class logits")


def test_classify_text_matches_transformers(imported, tmp_path):
    """``classify`` on text through the exported tokenizer: labels and logits of transformers."""
    from tfport.export import ExportOptions, export_model
    from tfport.runtime import load_model

    _, hf, directory, module = imported("classifier-cls")
    export_model(module, tmp_path / "export", ExportOptions(tokenizer=directory / "tokenizer.json"))
    model = load_model(tmp_path / "export", "cpu")
    texts = ["w5 w9 w17 w30 w31 w32 w33 w34 w35 w36", "w40 w41"]
    result = model.classify(texts)
    encoded = transformers.AutoTokenizer.from_pretrained(directory)(texts, padding=True, return_tensors="pt",
                                                                    return_token_type_ids=False)
    with torch.no_grad():
        logits = hf(**encoded).logits
    close(result.logits, logits, "classify(texts)")
    assert result.labels == [hf.config.id2label[i] for i in logits.argmax(-1).tolist()]


BASE = {"model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"], "vocab_size": VOCAB,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4}


@pytest.mark.parametrize("changes, field", [
    ({"hidden_activation": "mish"}, "hidden_activation='mish'"),
    ({"classifier_activation": "relu"}, "classifier_activation='relu'"),  # the MLM head's
    ({"architectures": ["ModernBertForSequenceClassification"], "classifier_pooling": "max"},
     "classifier_pooling='max'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types="),
    ({"local_attention": 0}, "local_attention=0"),
    ({"architectures": ["ModernBertForTokenClassification"]}, "ModernBertForTokenClassification"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"{field}".replace("[", r"\[").replace("(", r"\(")):
        hf_config_to_tfport({**BASE, **changes})


def test_ignored_fields_and_all_global_layers():
    """Options that do not change inference are accepted; one global layer in every one drops the
    window (and the local base, which no layer uses)."""
    config = hf_config_to_tfport({**BASE, "deterministic_flash_attn": True, "reference_compile": True,
                                  "sparse_prediction": True, "global_attn_every_n_layers": 1})
    assert config.window.size is None and config.rope.local_theta is None


def test_first_attn_norm_and_encoder_windows_are_validated(imported):
    config = imported("mlm")[3].config
    with pytest.raises(ValueError, match=r"config\.first_attn_norm=False"):
        config.replace(norm_position="post")
    t5 = dict(family="encoder-decoder", vocab_size=8, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
              n_decoder_layers=1, decoder_start_token_id=0, position="relative", window=WindowConfig(size=4))
    with pytest.raises(ValueError, match=r"config\.window\.size=4"):
        type(config)(**t5)
