"""lm-evaluation-harness's ``local-completions`` against ``tfport serve``: a small local
multiple-choice task (lm_eval_task/: six questions, four choices each) scored by lm-eval through
/v1/completions (``echo``, ``logprobs``, ``max_tokens: 1``, dropping the last entry as the token
generated) gives the loglikelihoods of tfport's own scoring (the library's forward over the
tokens) and of the PyTorch module the export was made from, within 1e-4 in float32.

The model is a tiny random decoder over a byte-level vocabulary whose head has a bias on [EOS],
set so that the token generated after about half the requests is [EOS]: before the server
scored and counted that token, lm-eval dropped the continuation's last token for those."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (extra 'dev')")
torch = pytest.importorskip("torch", reason="the reference module")
pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")

from tests.runtime.grammar_cases import VOCAB_SIZE, write_byte_tokenizer  # noqa: E402
from tests.runtime.serve.conftest import running_server  # noqa: E402

TASK = Path(__file__).parent / "lm_eval_task"
NAME = "tfport_tiny_mc"
EOS = 2  # [EOS] of grammar_cases' byte-level tokenizer
ATOL = 1e-4  # float32 ONNX Runtime against float32 PyTorch over ~50 tokens: ~1e-6 seen


def lm_eval_requests(tokenizer_file: Path) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) of every (question, choice) in the dataset's order, as
    lm-eval makes them: the whole text encoded without special tokens, the context's tokens
    cut off its front."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    out = []
    for line in (TASK / "tiny_mc.jsonl").read_text().splitlines():
        doc = json.loads(line)
        context = f"Question: {doc['question']}\nAnswer:"
        context_ids = tokenizer.encode(context, add_special_tokens=False).ids
        for choice in doc["choices"]:
            whole = tokenizer.encode(f"{context} {choice}", add_special_tokens=False).ids
            out.append((context_ids, whole[len(context_ids):]))
    return out


def loglikelihood(logits: np.ndarray, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's log-probabilities, whether each is the greedy token) from the
    logits [S, V] of one forward over context + continuation."""
    logprobs = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    rows = range(len(context) - 1, len(context) + len(continuation) - 1)
    return (float(sum(logprobs[r, t] for r, t in zip(rows, continuation))),
            all(logprobs[r].argmax() == t for r, t in zip(rows, continuation)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(export directory, PyTorch module, the HF tokenizer folder lm-eval loads, requests)."""
    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.presets import get_preset

    root = tmp_path_factory.mktemp("lm-eval")
    (root / "tokenizer").mkdir()
    tokenizer = write_byte_tokenizer(root / "tokenizer" / "tokenizer.json")
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[PAD]"}))
    requests = lm_eval_requests(tokenizer)
    config = get_preset("tiny-decoder").replace(vocab_size=VOCAB_SIZE, max_positions=256, d_model=64,
                                                tie_embeddings=False, lm_head_bias=True)
    module = build_model(config, seed=0).eval()
    with torch.no_grad():  # [EOS] the next token after half the requests' whole texts
        lacks = []
        for context, continuation in requests:
            last = module(torch.tensor([context + continuation]))[0][0, -1]  # [V]
            lacks.append(float(last.max() - last[EOS]))
        module.lm_head.bias[EOS] += float(np.median(lacks)) + 1e-3
    directory = root / "lm"
    export_model(module, directory, ExportOptions(tokenizer=tokenizer))
    return directory, module, root / "tokenizer", requests


def test_local_completions_equal_tfport_and_the_pytorch_module(exported, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    from tfport.runtime import load_model

    directory, module, tokenizer, requests = exported
    with torch.no_grad():
        module_logits = [module(torch.tensor([c + k]))[0][0].numpy() for c, k in requests]  # [S, V] each
    ends_in_eos = [int(logits[-1].argmax()) == EOS for logits in module_logits]
    assert 0 < sum(ends_in_eos) < len(requests), "the [EOS] bias must make some requests generate [EOS]"
    reference = [loglikelihood(logits, c, k) for logits, (c, k) in zip(module_logits, requests)]
    library = load_model(directory, intra_op_threads=1)
    runner = library.runner("decoder", "echo")
    own = [loglikelihood(library.decoding.logits(runner, np.array([c + k])), c, k) for c, k in requests]
    np.testing.assert_allclose([ll for ll, _ in own], [ll for ll, _ in reference], atol=ATOL)

    (tmp_path / f"{NAME}.yaml").write_text((TASK / f"{NAME}.yaml").read_text().replace("DATA_DIR", str(TASK)))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # not lm-eval's own thousands
    with running_server([directory], max_rows=4) as (url, _):
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": "lm", "base_url": url + "/v1/completions", "tokenizer_backend": "huggingface",
                        "tokenizer": str(tokenizer), "tokenized_requests": True, "num_concurrent": 1,
                        "max_retries": 1, "max_length": 256},
            tasks=[NAME], task_manager=tasks,
            log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    samples = sorted(results["samples"][NAME], key=lambda sample: sample["doc_id"])
    scored = [tuple(choice[0]) for sample in samples for choice in sample["resps"]]  # (ll, greedy)
    assert len(scored) == len(requests) == 24
    np.testing.assert_allclose([float(ll) for ll, _ in scored], [ll for ll, _ in reference], atol=ATOL)
    assert [bool(greedy) for _, greedy in scored] == [greedy for _, greedy in reference]
    accuracy = np.mean([np.argmax([ll for ll, _ in reference[4 * d:4 * d + 4]]) == json.loads(line)["answer"]
                        for d, line in enumerate((TASK / "tiny_mc.jsonl").read_text().splitlines())])
    assert results["results"][NAME]["acc,none"] == pytest.approx(accuracy)
