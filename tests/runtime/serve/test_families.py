"""Every family served: an encoder-decoder export on /v1/completions (tokens equal
``Model.generate``'s), a cross-encoder on /v1/rerank and /v1/score (scores equal
sentence-transformers' ``CrossEncoder.predict`` on the transformers checkpoint it was exported
from), a 3-label classifier on /v1/classify (transformers' probabilities), and embeddings batched across concurrent requests (vectors equal solo ``Model`` calls, in
fewer model calls than requests)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="needs the 'dev' extra's openai client")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from tfport.runtime import load_model  # noqa: E402
from tfport.runtime.tokenizer import cut_at_stop  # noqa: E402
from tfport.runtime.sampling import Logprobs  # noqa: E402
from tfport.runtime.serve.batcher import EmbeddingBatcher  # noqa: E402
from tfport.runtime.texts import EncodedTexts  # noqa: E402

from .conftest import _export, running_server  # noqa: E402

QUERY = "w5 w6 w7"
DOCUMENTS = ["w8 w9 w10 w11", "w50 w60", "w5 w6", "w90 w91 w92 w30 w31"]


@pytest.fixture(scope="module")
def family_exports(tmp_path_factory, serve_exports):
    """name -> export: ``s2s`` (tiny encoder-decoder, word-level tokenizer), ``rerank`` (a
    RobertaForSequenceClassification with one label, from its transformers directory, which
    ``checkpoint`` holds), ``classifier`` (an XLMRobertaForSequenceClassification with 3 labels,
    from ``classifier-checkpoint``), the conftest's ``dec`` and ``enc``."""
    pytest.importorskip("torch", reason="builds the reference models")
    from tests.hf.encoder_cases import CASES, build, save_with_tokenizer
    from tfport.export import export_checkpoint_or_preset

    root = tmp_path_factory.mktemp("families")
    case = CASES["roberta-reranker"]
    checkpoint = save_with_tokenizer(build(case), case, root / "checkpoint")
    export_checkpoint_or_preset(str(checkpoint), root / "rerank")
    labelled = CASES["xlmr-classifier"]
    classifier = save_with_tokenizer(build(labelled), labelled, root / "classifier-checkpoint")
    export_checkpoint_or_preset(str(classifier), root / "classifier")
    return {"classifier": root / "classifier", "classifier-checkpoint": classifier,"s2s": _export(root, "s2s", "tiny-encoder-decoder", "portable", {"tie_embeddings": False},
                           chat=False),
            "rerank": root / "rerank", "checkpoint": checkpoint,
            "dec": serve_exports["dec-portable"], "enc": serve_exports["enc"]}


@pytest.fixture(scope="module")
def family_server(family_exports):
    directories = [family_exports[name] for name in ("s2s", "rerank", "classifier", "dec", "enc")]
    with running_server(directories, max_rows=4, max_queue=16) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(family_server):
    return openai.OpenAI(base_url=family_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def s2s_model(family_exports):
    return load_model(family_exports["s2s"], intra_op_threads=1)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


# ---------------------------------------------------------------------------- encoder-decoder
def test_seq2seq_completions_equal_generate(client, s2s_model):
    """Greedy (text and ids) and seeded sampling with n=2 (choice i uses seed + i)."""
    model = s2s_model
    stops = model.stop_ids()
    prompt = model.tokenizer.encode("w17 w33 w8 w40")
    expected = cut_at_stop(model.generate([prompt], max_new_tokens=12, temperature=0)[0], stops)
    out = client.completions.create(model="s2s", prompt="w17 w33 w8 w40", max_tokens=12, temperature=0)
    assert out.choices[0].token_ids == expected
    assert out.choices[0].text == " ".join(f"w{t}" for t in expected if t >= 4)
    stopped = out.choices[0].finish_reason == "stop"  # the end-of-text generated counts (not in token_ids)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(expected) + stopped
    assert client.completions.create(model="s2s", prompt=prompt, max_tokens=12,
                                     temperature=0).choices[0].token_ids == expected
    sampled = client.completions.create(model="s2s", prompt=prompt, max_tokens=10, temperature=0.9,
                                        top_p=0.9, seed=11, n=2)
    for index, choice in enumerate(sampled.choices):
        solo = model.generate([prompt], max_new_tokens=10, temperature=0.9, top_p=0.9, seed=11 + index)
        assert choice.token_ids == cut_at_stop(solo[0], stops), index
    assert sampled.choices[0].token_ids != sampled.choices[1].token_ids  # two seeds, two draws


def test_concurrent_seq2seq_requests_equal_solo(client, s2s_model):
    """Six requests at once on 4 worker threads: each gets its own prompt's greedy tokens."""
    prompts = [[1, 4 + i, 30 + 2 * i, 60 + i] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model="s2s", prompt=p, max_tokens=10,
                                                                     temperature=0), prompts))
    stops = s2s_model.stop_ids()
    for prompt, answer in zip(prompts, answers):
        expected = cut_at_stop(s2s_model.generate([prompt], max_new_tokens=10, temperature=0)[0], stops)
        assert answer.choices[0].token_ids == expected, prompt


def test_seq2seq_stream_logprobs_and_stop(client, s2s_model):
    prompt = [1, 20, 21, 22]
    whole = client.completions.create(model="s2s", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    logprobs = Logprobs(top=2)
    s2s_model.generate([prompt], max_new_tokens=8, temperature=0, logprobs=logprobs)
    expected = [entry.logprob for entry in logprobs.rows[0]][:len(whole.choices[0].token_ids)]
    np.testing.assert_allclose(whole.choices[0].logprobs.token_logprobs, expected, rtol=1e-5, atol=1e-6)
    assert [len(top) for top in whole.choices[0].logprobs.top_logprobs] == [2] * len(expected)
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model="s2s", prompt=prompt, max_tokens=8, temperature=0, stream=True) if chunk.choices]
    assert "".join(pieces) == whole.choices[0].text
    words = whole.choices[0].text.split()
    cut = client.completions.create(model="s2s", prompt=prompt, max_tokens=8, temperature=0, stop=[words[2]])
    assert cut.choices[0].text == whole.choices[0].text[:whole.choices[0].text.index(words[2])]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "w5 w6", "echo": True}, "echo"),
    ({"prompt": "w5 w6", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "w5 w6", "max_tokens": 65}, "max_tokens"),  # the decoder's 64 positions
])
def test_seq2seq_refuses_what_does_not_apply(family_server, body, param):
    response = post(family_server[0], "/v1/completions", {"model": "s2s", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_seq2seq_max_tokens_is_bounded_by_the_decoder_alone(client):
    """A 60-token prompt (the encoder's) leaves the decoder's 64 positions free, where a
    decoder-only export would have room for 5 more tokens."""
    out = client.completions.create(model="s2s", prompt=[5] * 60, max_tokens=64, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 64 and out.choices[0].finish_reason == "length"


def test_seq2seq_has_no_chat_and_reports_health(family_server):
    url, _ = family_server
    response = post(url, "/v1/chat/completions", {"model": "s2s", "messages": [{"role": "user", "content": "w5"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    health = httpx.get(url + "/health").json()["models"]["s2s"]
    assert health["family"] == "encoder-decoder" and health["alive"]


# ------------------------------------------------------------------------------ cross-encoders
@pytest.fixture(scope="module")
def cross_encoder(family_exports):
    st = pytest.importorskip("sentence_transformers", reason="the reference; the 'dev' extra installs it")
    return st.CrossEncoder(str(family_exports["checkpoint"]), device="cpu")


def pair_tokens(family_exports, texts, pairs) -> int:
    """Tokens of the (text, pair) rows as transformers' tokenizer of the checkpoint counts them."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(family_exports["checkpoint"])
    return sum(len(ids) for ids in tokenizer(texts, pairs)["input_ids"])


def test_rerank_orders_by_cross_encoder_scores(family_server, family_exports, cross_encoder):
    url, _ = family_server
    expected = cross_encoder.predict([(QUERY, document) for document in DOCUMENTS])
    body = post(url, "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS}).json()
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected[[r["index"] for r in results]],
                               rtol=1e-4, atol=1e-6)
    assert [r["index"] for r in results] == np.argsort(-expected, kind="stable").tolist()  # best first
    assert "document" not in results[0]
    assert body["usage"]["prompt_tokens"] == pair_tokens(family_exports, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    for path in ("/rerank", "/v1/reranking"):  # llama-server's aliases
        top = post(url, path, {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                               "return_documents": True}).json()["results"]
        assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
        assert [r["document"]["text"] for r in top] == [DOCUMENTS[r["index"]] for r in top]


def test_score_pairs_equal_cross_encoder(family_server, cross_encoder):
    url, _ = family_server
    one = post(url, "/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([d["score"] for d in one["data"]],
                               cross_encoder.predict([(QUERY, d) for d in DOCUMENTS]), rtol=1e-4, atol=1e-6)
    assert [d["index"] for d in one["data"]] == list(range(len(DOCUMENTS)))
    firsts = ["w40 w41", "w12"]
    pairwise = post(url, "/v1/score", {"model": "rerank", "text_1": firsts, "text_2": DOCUMENTS[:2]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               cross_encoder.predict(list(zip(firsts, DOCUMENTS[:2]))), rtol=1e-4, atol=1e-6)


def test_rerank_and_score_tokenise_each_pair_once(family_server, monkeypatch):
    """One tokenizer pass per request: the pairs were tokenised for the usage count, then again
    by ``Model.classify``."""
    from tfport.runtime.texts import TruncatingTokenizer

    tokenised = []
    encode = TruncatingTokenizer.encode

    def counting(self, texts, pairs=None):
        tokenised.extend(zip(texts, pairs or [None] * len(texts)))
        return encode(self, texts, pairs)

    monkeypatch.setattr(TruncatingTokenizer, "encode", counting)
    for path, body in (("/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS}),
                       ("/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": DOCUMENTS})):
        tokenised.clear()
        assert post(family_server[0], path, body).status_code == 200
        assert tokenised == [(QUERY, document) for document in DOCUMENTS], path


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"model": "rerank", "query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
    ("/v1/rerank", {"model": "dec-portable", "query": QUERY, "documents": DOCUMENTS}, "model"),
    ("/v1/rerank", {"model": "enc", "query": QUERY, "documents": DOCUMENTS}, "model"),
    ("/v1/score", {"model": "s2s", "text_1": QUERY, "text_2": DOCUMENTS}, "model"),
    ("/v1/score", {"model": "rerank", "text_1": ["w5", "w6"], "text_2": DOCUMENTS}, "text_2"),
    ("/v1/score", {"model": "rerank", "text_1": [], "text_2": "w5"}, "text_1"),
    ("/v1/rerank", {"model": "classifier", "query": QUERY, "documents": DOCUMENTS}, "model"),
    ("/v1/classify", {"model": "dec-portable", "input": "w5"}, "model"),
    ("/v1/classify", {"model": "classifier", "input": []}, "input"),
])
def test_scoring_errors_name_the_field(family_server, path, body, param):
    response = post(family_server[0], path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_classify_equals_transformers(family_server, family_exports):
    """Labels and softmax probabilities of the checkpoint's own model on its tokenizer's ids."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["w5 w9 w17", "w40 w41", "w70 w71 w72 w73 w74"]
    directory = family_exports["classifier-checkpoint"]
    hf = AutoModelForSequenceClassification.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(**AutoTokenizer.from_pretrained(directory)(texts, padding=True, return_tensors="pt")).logits
    body = post(family_server[0], "/v1/classify", {"model": "classifier", "input": texts}).json()
    np.testing.assert_allclose([d["probs"] for d in body["data"]], torch.softmax(logits, -1).numpy(),
                               rtol=1e-4, atol=1e-6)
    assert [d["label"] for d in body["data"]] == [hf.config.id2label[i] for i in logits.argmax(-1).tolist()]
    assert [d["num_classes"] for d in body["data"]] == [3] * len(texts)


# --------------------------------------------------------------------------- batched embeddings
def test_concurrent_embeddings_are_batched_and_equal_solo(family_exports):
    """16 concurrent requests within a 300 ms window: fewer model calls than requests, and each
    request's vectors those of the library on its inputs alone."""
    inputs = [[f"w{4 + (7 * i + j) % 90}" for j in range(1 + i % 5)] for i in range(16)]
    requests = [[" ".join(words), " ".join(reversed(words)) + " w9"] for words in inputs]
    with running_server([family_exports["enc"]], embedding_batch_ms=300) as (url, state):
        batcher = state.models["enc"].batcher
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda texts: post(url, "/v1/embeddings", {"model": "enc", "input": texts}),
                                    requests))
        model = load_model(family_exports["enc"], intra_op_threads=1)
        for texts, answer in zip(requests, answers):
            got = np.array([item["embedding"] for item in answer.json()["data"]])
            np.testing.assert_allclose(got, model.embed_text(texts), rtol=1e-5, atol=1e-5)
        assert batcher.batches < len(requests) / 2, batcher.batches


def test_batcher_bounds_batch_tokens():
    """Batches hold at most ``max_tokens`` tokens (a larger request alone), in arrival order,
    and each request gets its own rows back."""
    seen: list[list[list[int]]] = []

    def embed_rows(encoded: EncodedTexts) -> np.ndarray:
        seen.append(encoded.ids)
        return np.array([[float(sum(row))] for row in encoded.ids], np.float32)

    def request(*lengths: int) -> EncodedTexts:
        rows = [[length] * length for length in lengths]
        return EncodedTexts(rows, [[0] * n for n in lengths], [False] * len(lengths))

    async def run():
        batcher = EmbeddingBatcher(embed_rows, window_s=0.05, max_tokens=10)
        calls = [request(3), request(2, 2), request(12), request(4), request(5), request(1)]
        return await asyncio.gather(*(batcher.embed(call) for call in calls))

    results = asyncio.run(run())
    assert [[len(row) for row in batch] for batch in seen] == [[3, 2, 2], [12], [4, 5, 1]]
    assert [r[:, 0].tolist() for r in results] == [[9.0], [4.0, 4.0], [144.0], [16.0], [25.0], [1.0]]
