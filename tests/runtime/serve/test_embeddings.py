"""``/v1/embeddings`` embeds as ``tfport embed`` does: the export's sentence-transformers pipeline
(pooling, Normalize, truncation at ``max_seq_length``), so the served vectors equal
``Model.embed_text``'s and ``SentenceTransformer.encode``'s.

The models are tiny sentence-transformers pipelines over one random BERT (2 layers, E=32) with a
WordPiece tokenizer, saved by sentence-transformers and exported from that directory as a user
would (``export_checkpoint_or_preset``): CLS, mean and last-token pooling, each with and without
a Normalize module, truncating at 12 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")
sentence_transformers = pytest.importorskip("sentence_transformers", reason="the reference; the "
                                            "'dev' extra installs sentence-transformers")
torch = pytest.importorskip("torch", reason="builds the reference models")
transformers = pytest.importorskip("transformers", reason="builds the reference models")

from tfport.runtime import load_model  # noqa: E402

from .conftest import running_server  # noqa: E402

MAX_SEQ_LENGTH = 12  # tokens, [CLS] and [SEP] included; the second text is cut there
WORDS = "the a man woman dog cat eats runs food bread horse rides export model onnx runtime".split()
TEXTS = ["the man eats food", "a dog runs " * 8 + "and a cat rides a horse", "export the onnx model",
         "bread"]
# float32 ONNX Runtime against float32 PyTorch through 2 layers: ~1e-7; Normalize-free vectors
# have norms of ~6, hence a relative term.
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    pooling: str  # sentence-transformers' pooling_mode
    normalize: bool  # a Normalize module after the pooling

    @property
    def name(self) -> str:
        return f"{self.pooling}-{'normalize' if self.normalize else 'raw'}"


CASES = [Case(pooling, normalize) for pooling in ("cls", "mean", "lasttoken") for normalize in (True, False)]


def tiny_bert(directory: Path) -> Path:
    """A random BERT with a cased WordPiece tokenizer (``tokenizer.json``), saved by transformers."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    directory.mkdir()
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=False,
                                               model_max_length=MAX_SEQ_LENGTH)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                     initializer_range=0.2)  # larger weights: vectors vary with the text
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """case name -> (export directory, its SentenceTransformer)."""
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from tfport.export import export_checkpoint_or_preset

    root = tmp_path_factory.mktemp("st-serve")
    bert = tiny_bert(root / "bert")
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # everything is local
        for case in CASES:
            modules = [Transformer(str(bert), max_seq_length=MAX_SEQ_LENGTH),
                       Pooling(32, pooling_mode=case.pooling)]
            if case.normalize:
                modules.append(Normalize())
            model = sentence_transformers.SentenceTransformer(modules=modules, device="cpu")
            checkpoint = root / f"st-{case.name}"
            model.save(str(checkpoint))
            export_checkpoint_or_preset(str(checkpoint), root / case.name)
            out[case.name] = (root / case.name, model)
    return out


MATRYOSHKA = (8, 16)  # the lengths the "matryoshka" export declares its vectors may be cut to


@pytest.fixture(scope="module")
def matryoshka(pipelines) -> Path:
    """The mean-normalize pipeline exported declaring ``MATRYOSHKA`` (as a model trained with
    Matryoshka loss would): embedding.json's ``matryoshka_dimensions``."""
    import dataclasses

    from tfport.export import ExportOptions, export_checkpoint_or_preset
    from tfport.export.sentence_transformers import read_sentence_transformers

    directory = pipelines["mean-normalize"][0]
    checkpoint = directory.parent / "st-mean-normalize"
    embedding = dataclasses.replace(read_sentence_transformers(checkpoint), matryoshka_dimensions=MATRYOSHKA)
    out = directory.parent / "matryoshka"
    export_checkpoint_or_preset(str(checkpoint), out, ExportOptions(embedding=embedding))
    return out


@pytest.fixture(scope="module")
def server(pipelines, matryoshka):
    with running_server([*(directory for directory, _ in pipelines.values()), matryoshka]) as (url, _):
        yield url


def served(url: str, name: str, inputs) -> tuple[np.ndarray, dict]:
    response = httpx.post(url + "/v1/embeddings", json={"model": name, "input": inputs}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], np.float32), body["usage"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_texts_equal_embed_text_and_sentence_transformers(pipelines, server, case):
    directory, st = pipelines[case.name]
    expected = st.encode(TEXTS, convert_to_numpy=True)
    model = load_model(directory, intra_op_threads=1)
    lengths = [len(ids) for ids in model.encode_texts(TEXTS).ids]
    assert len(model.tokenizer.encode(TEXTS[1])) > MAX_SEQ_LENGTH == lengths[1]  # really truncated
    norms = np.linalg.norm(expected, axis=-1)
    assert np.allclose(norms, 1) == case.normalize  # the case is what it says

    np.testing.assert_allclose(model.embed_text(TEXTS), expected, rtol=RTOL, atol=ATOL)
    vectors, usage = served(server, case.name, TEXTS)
    np.testing.assert_allclose(vectors, expected, rtol=RTOL, atol=ATOL)
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(lengths)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_token_ids_take_the_exports_pooling(pipelines, server, case):
    """Token ids are embedded as given, with the export's pooling and normalisation: the ids of
    the truncated texts give ``SentenceTransformer.encode``'s vectors of the texts."""
    directory, st = pipelines[case.name]
    ids = load_model(directory, intra_op_threads=1).encode_texts(TEXTS).ids
    vectors, usage = served(server, case.name, ids)
    np.testing.assert_allclose(vectors, st.encode(TEXTS, convert_to_numpy=True), rtol=RTOL, atol=ATOL)
    assert usage["prompt_tokens"] == sum(len(row) for row in ids)
    one, _ = served(server, case.name, ids[0])  # one list of ids is one input
    np.testing.assert_allclose(one, vectors[:1], rtol=RTOL, atol=ATOL)


def test_token_ids_past_the_context_are_refused(pipelines, server):
    response = httpx.post(server + "/v1/embeddings", json={"model": CASES[0].name, "input": [[5] * 65]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and "64" in error["message"], error


def test_dimensions_cut_a_matryoshka_export_and_are_refused_elsewhere(pipelines, server):
    """``dimensions`` (OpenAI's): the first d of each vector, normalised again where the export
    normalises, for the d the export declares; a 400 naming ``dimensions`` elsewhere."""
    full = pipelines["mean-normalize"][1].encode(TEXTS, convert_to_numpy=True)  # [B, 32], unit rows
    for dimensions in (*MATRYOSHKA, 32):
        response = httpx.post(server + "/v1/embeddings", json={"model": "matryoshka", "input": TEXTS,
                                                               "dimensions": dimensions}, timeout=60)
        assert response.status_code == 200, response.text
        vectors = np.array([d["embedding"] for d in response.json()["data"]])
        cut = full[:, :dimensions]
        np.testing.assert_allclose(vectors, cut / np.linalg.norm(cut, axis=-1, keepdims=True),
                                   rtol=RTOL, atol=ATOL)
    for model, dimensions, message in (("matryoshka", 12, "one of [8, 16]"),
                                       ("mean-normalize", 8, "declares no Matryoshka dimensions"),
                                       ("matryoshka", 0, "greater than or equal to 1")):
        response = httpx.post(server + "/v1/embeddings", json={"model": model, "input": TEXTS,
                                                               "dimensions": dimensions}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "dimensions" and message in error["message"], error
