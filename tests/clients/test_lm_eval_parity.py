"""lm-evaluation-harness's ``local-completions`` against ``tfport serve`` equals ``lm_eval --model
hf`` on the same float32 weights within 1e-4 per loglikelihood (issue 41 asks 1e-3; 5e-6 seen).

A tiny random Llama (``LlamaForCausalLM``, every parameter perturbed, fixed seed) with a
byte-level BPE ``tokenizer.json`` whose post-processor puts ``[BOS]`` in front, as Llama's does,
is saved as a Hugging Face directory and exported from it in float32 as ``tfport export DIR``
does. lm-eval runs a local multiple-choice task (written under tmp_path: 16 questions, 2-4 choices,
single- and multi-token continuations) once with ``model="hf"`` on the directory and once with
``model="local-completions"`` against the export served on 127.0.0.1; every request's
loglikelihood and greedy flag, and the task's accuracies, must agree.

``local-completions`` is given ``add_bos_token=True``: lm-eval 0.4.13's ``hf`` model encodes with
the tokenizer's own special tokens (``[BOS]`` here), its ``local-completions`` without them unless
told; left at its default the two score different token sequences whatever the server does
(up to 5.1 apart on this task, and acc_norm differs). The prompt is sent as token ids
(``tokenized_requests=True``, what docs/clients.md recommends). As text it cannot agree with a
tokenizer that adds [BOS] (the xfail case below, kept strict so a change shows): lm-eval decodes
its ids, [BOS] included, and the server's encode of that text adds [BOS] again.

The lm head's row of " yes" is raised along the hidden states that precede it so that it is the
greedy token after about half of the yes/no questions: the greedy flags are not all False."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (extra 'dev')")
torch = pytest.importorskip("torch", reason="lm-eval's hf model and the exporter need torch (extra 'export')")
transformers = pytest.importorskip("transformers", reason="lm-eval's hf model (extra 'dev')")
pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")

from tests.hf.cases import perturbed_model, save_hf  # noqa: E402
from tests.runtime.serve.conftest import running_server  # noqa: E402

NAME = "tfport_hf_parity_mc"
SERVED = "llama"  # the export directory's name: the served model id
ATOL = 1e-4  # the issue asks 1e-3 of the target, 1e-4 of the reference; float32 against float32: 5e-6 seen
SPECIALS = ["[PAD]", "[BOS]", "[EOS]"]  # ids 0, 1, 2 as in the model's config
VOCAB = 384  # the model's; the tokenizer has fewer (an unused tail, as padded vocabularies have)
YES = " yes"

DOCS = [
    ("Which planet do we live on?", ["Earth", "Mars", "Venus", "Jupiter"], 0),
    ("What colour is the sky on a clear day?", ["green", "blue", "red"], 1),
    ("How many legs does a spider have?", ["six", "eight"], 1),
    ("Which animal says moo?", ["a cat", "a dog", "a cow"], 2),
    ("What do bees make?", ["honey", "milk", "silk", "wax paper"], 0),
    ("Which is the largest ocean?", ["the Atlantic", "the Pacific", "the Indian", "the Arctic"], 1),
    ("Is ice cold?", ["yes", "no"], 0),
    ("Is fire wet?", ["yes", "no"], 1),
    ("Can fish swim?", ["yes", "no"], 0),
    ("Do cows fly?", ["yes", "no"], 1),
    ("Is the sun a star?", ["yes", "no"], 0),
    ("Is a cat a plant?", ["yes", "no", "maybe"], 1),
    ("What is two plus two?", ["four", "five", "twenty-two"], 0),
    ("Which season is the coldest?", ["summer", "winter", "spring", "autumn"], 1),
    ("What do we breathe?", ["air", "water"], 0),
    ("Where does the sun rise?", ["in the east", "in the west", "at noon"], 0),
]
# Words merged into one token each (byte-level, "Ġ" a space): the other choices are spelt in
# several tokens.
WORDS = ["Question", ":", "Answer", "Ġthe", "Ġis", "ĠEarth", "ĠMars", "Ġblue", "Ġred", "Ġsix", "Ġeight",
         "Ġhoney", "Ġmilk", "Ġyes", "Ġno", "Ġfour", "Ġfive", "Ġair", "Ġwinter", "Ġsummer"]


def write_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer.json: the 256 byte symbols, ``WORDS`` built left to right by
    merges, and a post-processor that puts [BOS] in front (Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {name: i for i, name in enumerate(SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    merges = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[:end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    assert len(vocab) < VOCAB
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    tokenizer.save(str(path))
    return path


def context(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def write_task(root: Path) -> Path:
    """The task's YAML and JSONL data in ``root`` (lm-eval's ``json`` dataset: no download)."""
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (root / f"{NAME}.yaml").write_text(f"""\
task: {NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return root


def raise_yes(model, tokenizer) -> None:
    """Add to the lm head's " yes" row a multiple of the mean last hidden state of the yes/no
    questions' contexts, just enough that " yes" is the greedy next token after half of them
    (the head is untied: the hidden states do not change)."""
    yes, = tokenizer.encode(YES, add_special_tokens=False)
    contexts = [tokenizer.encode(context(q)) for q, choices, _ in DOCS if YES.strip() in choices]
    with torch.no_grad():
        hidden = torch.stack([model.model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in contexts])
        logits = model.lm_head(hidden)  # [Q, V]
        direction = hidden.mean(0) / hidden.mean(0).norm()
        along = hidden @ direction  # how much a unit of ``direction`` raises each context's " yes"
        assert (along > 0).all()
        needed = (logits.max(-1).values - logits[:, yes]) / along
        model.lm_head.weight[yes] += direction * (float(needed.median()) + 1e-2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(the Hugging Face directory, its float32 tfport export)."""
    from transformers import PreTrainedTokenizerFast

    from tfport.export import ExportOptions, export_checkpoint_or_preset

    root = tmp_path_factory.mktemp("lm-eval-parity")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    write_tokenizer(hf_dir / "tokenizer.json")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[PAD]", "model_max_length": 256}))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    model = perturbed_model("LlamaConfig", "LlamaForCausalLM", 41, vocab_size=VOCAB, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0, initializer_range=0.1, hidden_size=64,
                            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise_yes(model, tokenizer)
    save_hf(model, hf_dir)
    export_checkpoint_or_preset(str(hf_dir), root / SERVED, ExportOptions(dtype="float32"))  # = tfport export
    return hf_dir, root / SERVED


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, model_dirs):
    from lm_eval.tasks import TaskManager

    folder = write_task(tmp_path_factory.mktemp("lm-eval-task"))
    return TaskManager(include_path=str(folder), include_defaults=False)  # not lm-eval's own thousands


def evaluate(tasks, model: str, model_args: dict) -> tuple[list[dict], dict]:
    """lm-eval's samples (by doc) and the task's metrics."""
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[NAME], task_manager=tasks,
                                      log_samples=True, random_seed=0, numpy_random_seed=0,
                                      torch_random_seed=0, fewshot_random_seed=0)
    return sorted(results["samples"][NAME], key=lambda s: s["doc_id"]), results["results"][NAME]


def scored(samples: list[dict]) -> tuple[list[float], list[bool], list[list[int]]]:
    """Every request's (loglikelihood, greedy) in the dataset's order, and each doc's request
    arguments (context, continuation) to check both runs asked the same."""
    pairs = [tuple(choice[0]) for sample in samples for choice in sample["resps"]]
    return [float(ll) for ll, _ in pairs], [bool(g) for _, g in pairs], [s["arguments"] for s in samples]


@pytest.fixture(scope="module")
def offline():
    """No hub: datasets and transformers read the local files only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def hf_run(model_dirs, tasks, offline):
    """``lm_eval --model hf`` on the directory: (samples, metrics)."""
    hf_dir, _ = model_dirs
    return evaluate(tasks, "hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu",
                                  "batch_size": 1})


TEXT_DOUBLES_BOS = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "text prompts with a tokenizer that adds [BOS]: lm-eval decodes its ids, [BOS] included, to "
    "'[BOS]Question: ...' and the server's encode adds the post-processor's [BOS] again (as "
    "transformers' does), so the server scores one token more than lm-eval's context length "
    "counts; send token ids"))


@pytest.mark.parametrize("tokenized", [True, pytest.param(False, marks=TEXT_DOUBLES_BOS)],
                         ids=["token-ids", "text"])
def test_local_completions_equal_lm_eval_hf(model_dirs, tasks, hf_run, offline, tokenized):
    hf_dir, export = model_dirs
    with running_server([export], max_rows=4) as (url, _):
        samples, metrics = evaluate(tasks, "local-completions", {
            "model": SERVED, "base_url": url + "/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(hf_dir), "tokenized_requests": tokenized, "add_bos_token": True,
            "num_concurrent": 1, "max_retries": 1, "max_length": 256})
    hf_samples, hf_metrics = hf_run
    lls, greedy, arguments = scored(samples)
    hf_lls, hf_greedy, hf_arguments = scored(hf_samples)
    assert arguments == hf_arguments
    assert len(lls) == sum(len(choices) for _, choices, _ in DOCS) == 45

    # the comparison can fail: the loglikelihoods differ from each other, none is near zero,
    # and some requests are greedy, some not
    assert len(set(np.round(hf_lls, 3))) == len(hf_lls) and max(hf_lls) < -1
    assert 0 < sum(hf_greedy) < len(hf_greedy)

    difference = np.abs(np.array(lls) - np.array(hf_lls))
    print(f"\nlocal-completions ({'token ids' if tokenized else 'text'}) vs hf: max |loglikelihood "
          f"difference| {difference.max():.2e} over {len(lls)} requests, {sum(hf_greedy)} greedy")
    np.testing.assert_allclose(lls, hf_lls, rtol=0, atol=ATOL)
    assert greedy == hf_greedy
    assert metrics["acc,none"] == hf_metrics["acc,none"]
    assert metrics["acc_norm,none"] == hf_metrics["acc_norm,none"]


def test_the_requests_cover_single_and_multi_token_continuations_after_bos(model_dirs):
    """What the task sends: the contexts start with [BOS] (the tokenizer's post-processor), and
    continuations are one token for some choices and several for others."""
    from transformers import PreTrainedTokenizerFast

    hf_dir, _ = model_dirs
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    lengths = []
    for question, choices, _ in DOCS:
        ctx = tokenizer.encode(context(question))
        assert ctx[0] == 1 and ctx.count(1) == 1
        for choice in choices:
            whole = tokenizer.encode(f"{context(question)} {choice}")
            assert whole[:len(ctx)] == ctx
            lengths.append(len(whole) - len(ctx))
    assert 1 in lengths and max(lengths) >= 4
