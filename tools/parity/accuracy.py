"""What quantisation costs on real weights, measured against the unquantised model as the field
does (``tfport parity --accuracy``, ``tfport bench --pareto``, ``--max-loss``):

- perplexity on a fixed held-out text, and its increase over float32's;
- on the same text, the KL divergence of each position's next-token distribution from float32's
  and the share of positions whose most likely token is float32's (llama.cpp's
  ``llama-perplexity --kl-divergence``: mean KL and "same top p"), ``divergence``;
- greedy answers to short chat questions (``CHAT_QUESTIONS``, through the model's chat template)
  equal to float32's, token for token up to the end of the turn, ``answer_agreement``.

Perplexity alone can mislead: a quantisation that is better on average over a text can still
move the top token where an answer depends on it (issue 43: a lower perplexity than
onnxruntime-genai's int4 that answered "What is the capital of France?" with nonsense).

The exact check of a quantised graph is ordinary parity against the fake-quantised module (same
dequantised weights, float32 tolerances, ``Runner``); this module measures the *approximation*:
the export as shipped (ONNX Runtime's int8-activation kernels included) against the module with
its original weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

# package data, held out: calibration never reads it
PERPLEXITY_TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean NLL) of ``ids`` [S] under ``logits`` [S, V] (position s predicts s + 1)."""
    logp = log_softmax(logits[:-1].astype(np.float64))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


@torch.no_grad()
def reference_logits(model: nn.Module, ids: np.ndarray) -> np.ndarray:
    """The module's logits [S, V] for one sequence ``ids`` [S]."""
    tokens = torch.from_numpy(ids[None])
    logits, _ = model(tokens, torch.ones_like(tokens))
    return logits[0].float().numpy()


def export_logits(model_dir: str | Path, ids: np.ndarray) -> np.ndarray:
    """An export's logits [S, V] for one sequence ``ids`` [S], through the runtime's sessions and
    cache layout."""
    from tfport.runtime import load_model

    model = load_model(model_dir)
    runner = model.runners["decoder"]
    return model.decoding.logits(runner, np.asarray(ids, dtype=np.int64)[None])  # [S, V]


@dataclass(frozen=True)
class Divergence:
    """A model's next-token distributions against the reference's over one text: the KL
    divergence KL(reference || model) per position in nats (mean, median, 99th percentile) and
    the share of positions whose argmax is the reference's (``top1``)."""

    kl_mean: float
    kl_median: float
    kl_p99: float
    top1: float
    positions: int

    def to_dict(self) -> dict:
        return {"kl_mean": self.kl_mean, "kl_median": self.kl_median, "kl_p99": self.kl_p99,
                "top1": self.top1, "positions": self.positions}


def divergence(reference: np.ndarray, logits: np.ndarray, chunk: int = 256) -> Divergence:
    """``logits`` [S, V] against ``reference`` [S, V] (the unquantised model's, same ids) at the
    S - 1 positions that predict a token of the text (as ``perplexity``), in float64, ``chunk``
    positions at a time (SmolLM2's V = 49152: 100 MB a chunk)."""
    if reference.shape != logits.shape or reference.ndim != 2:
        raise ValueError(f"logits of shape {logits.shape}: expected the reference's {reference.shape} ([S, V])")
    kl, same = [], 0
    for start in range(0, len(reference) - 1, chunk):
        end = min(start + chunk, len(reference) - 1)
        p = log_softmax(reference[start:end].astype(np.float64))
        q = log_softmax(logits[start:end].astype(np.float64))
        kl.append((np.exp(p) * (p - q)).sum(axis=-1))
        same += int((reference[start:end].argmax(-1) == logits[start:end].argmax(-1)).sum())
    kl = np.concatenate(kl)
    return Divergence(float(kl.mean()), float(np.median(kl)), float(np.percentile(kl, 99)),
                      same / len(kl), len(kl))


# Short factual questions that float32 SmolLM2-135M-Instruct answers in one sentence that ends its
# turn (questions it answers at length were left out: an exact match of 32 rambling tokens
# measures drift more than the answer). The README's example is the first.
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Germany?",
    "What is the capital of Egypt?",
    "What is the capital of Australia?",
    "How many days are there in a week?",
    "What is 2 plus 2?",
    "What is 3 times 3?",
    "How many legs does a dog have?",
    "What is the largest ocean on Earth?",
)
ANSWER_TOKENS = 32  # an answer is compared up to the end of its turn or this many tokens


def source_chat_format(template: str, tokenizer: str | Path, config):
    """The runtime's ``ChatFormat`` of a source's chat template (its text) and tokenizer.json,
    with ``config``'s special token ids: the prompts an export of that source would render."""
    from tfport.runtime.chat import ChatFormat
    from tfport.runtime.tokenizer import TextTokenizer

    return ChatFormat(template, TextTokenizer(tokenizer), config.bos_token_id, config.eos_token_id,
                      config.pad_token_id)


def export_chat_format(model_dir: str | Path):
    """An export's ``ChatFormat`` (its chat template and tokenizer); ``ValueError`` without them."""
    from tfport.runtime import load_model
    from tfport.runtime.chat import chat_format

    return chat_format(load_model(model_dir))


def chat_prompts(fmt, questions=CHAT_QUESTIONS) -> list[list[int]]:
    """The prompt ids of each question as one user turn through ``fmt`` (a ``ChatFormat``: the
    template's default system message, if any, included); ``fmt.stop_ids`` end the answers."""
    return [fmt.prompt_ids([{"role": "user", "content": q}]) for q in questions]


def cut_answer(tokens, stop_ids, limit: int = ANSWER_TOKENS) -> tuple[int, ...]:
    """``tokens`` up to (without) the first of ``stop_ids``, at most ``limit``."""
    out = []
    for token in list(tokens)[:limit]:
        if int(token) in stop_ids:
            break
        out.append(int(token))
    return tuple(out)


@torch.no_grad()
def reference_answers(model: nn.Module, prompts: list[list[int]], stop_ids: tuple[int, ...],
                      limit: int = ANSWER_TOKENS) -> list[tuple[int, ...]]:
    """The module's greedy answer to each prompt, alone (batch 1), cut at the end of the turn."""
    from tfport.models.generate import generate

    return [cut_answer(generate(model, torch.tensor([p]), max_new_tokens=limit,
                                eos_token_id=stop_ids[0] if len(stop_ids) == 1 else None)[0].tolist(),
                       stop_ids, limit) for p in prompts]


def export_answers(model_dir: str | Path, prompts: list[list[int]], stop_ids: tuple[int, ...],
                   limit: int = ANSWER_TOKENS) -> list[tuple[int, ...]]:
    """An export's greedy answer to each prompt through the runtime, one prompt at a time (as
    ``tfport chat``), unpenalised whatever its generation_config.json says."""
    from tfport.runtime import load_model

    runtime = load_model(model_dir)
    return [cut_answer(runtime.generate([p], max_new_tokens=limit, stop_token_ids=stop_ids, temperature=0.0,
                                        repetition_penalty=1.0)[0], stop_ids, limit) for p in prompts]


def answer_agreement(expected: list[tuple[int, ...]], got: list[tuple[int, ...]]) -> float:
    """The share of answers equal to the expected ones, token for token."""
    if len(expected) != len(got) or not expected:
        raise ValueError(f"answers: expected {len(expected)} answers (at least one), got {len(got)}")
    return sum(e == g for e, g in zip(expected, got)) / len(expected)


def greedy(model_dir: str | Path, prompts: list[list[int]], steps: int) -> np.ndarray:
    from tfport.runtime import load_model

    return load_model(model_dir).generate(prompts, max_new_tokens=steps, stop_token_ids=())


@dataclass
class AccuracyRow:
    name: str
    perplexity: float
    perplexity_ratio: float  # over the float32 reference's
    greedy_agreement: float | None  # fraction of greedy tokens equal to the float32 export's
    divergence: Divergence | None = None  # from the float32 reference's distributions, same text
    answers: float | None = None  # share of CHAT_QUESTIONS answered as the reference does

    def describe(self) -> str:
        def share(value: float | None) -> str:
            return "-" if value is None else f"{value:.0%}"

        kl = "-" if self.divergence is None else f"{self.divergence.kl_mean:.4f}"
        top1 = "-" if self.divergence is None else f"{self.divergence.top1:.1%}"
        return (f"{self.name:<28} {self.perplexity:>10.3f} {self.perplexity_ratio:>8.3f} {kl:>8} {top1:>7} "
                f"{share(self.greedy_agreement):>9} {share(self.answers):>8}")


HEADER = f"{'model':<28} {'perplexity':>10} {'vs fp32':>8} {'KL':>8} {'top-1':>7} {'greedy':>9} {'answers':>8}"


def first_divergence(expected: np.ndarray, actual: np.ndarray) -> float:
    """Greedy agreement: per row, the fraction of tokens before the first difference (after a
    difference the two continue from different texts, so later matches mean little)."""
    agree = []
    for e, a in zip(expected, actual):
        diff = np.nonzero(e != a)[0]
        agree.append((diff[0] if diff.size else len(e)) / len(e))
    return float(np.mean(agree))
