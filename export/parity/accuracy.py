"""What quantisation costs on real weights: perplexity on a fixed text and greedy agreement with the
float32 model, for exports against their unquantised reference (``tfport parity --accuracy``).

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

PERPLEXITY_TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"  # package data, beside calibration.txt


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
    """An export's logits [S, V] for one sequence ``ids`` [S] (its decoder must return every
    position's logits, ``logits="all"``), through the runtime's sessions and cache layout."""
    from tfport.runtime import load_model

    model = load_model(model_dir)
    runner = model.runners["decoder"]
    if runner.spec.outputs[0].shape[1] == 1:
        raise ValueError(f"model_dir={str(model_dir)!r}: exported with logits='last'; perplexity "
                         "needs every position's logits (re-export with logits='all')")
    return model.decoding.score(runner, np.asarray(ids, dtype=np.int64)[None])  # [S, V]


def greedy(model_dir: str | Path, prompts: list[list[int]], steps: int) -> np.ndarray:
    from tfport.runtime import load_model

    return load_model(model_dir).generate(prompts, max_new_tokens=steps, stop_token_ids=())


@dataclass
class AccuracyRow:
    name: str
    perplexity: float
    perplexity_ratio: float  # over the float32 reference's
    greedy_agreement: float | None  # fraction of greedy tokens equal to the float32 export's

    def describe(self) -> str:
        agreement = "-" if self.greedy_agreement is None else f"{self.greedy_agreement:.0%}"
        return f"{self.name:<28} {self.perplexity:>10.3f} {self.perplexity_ratio:>8.3f} {agreement:>9}"


HEADER = f"{'model':<28} {'perplexity':>10} {'vs fp32':>8} {'greedy':>9}"


def first_divergence(expected: np.ndarray, actual: np.ndarray) -> float:
    """Greedy agreement: per row, the fraction of tokens before the first difference (after a
    difference the two continue from different texts, so later matches mean little)."""
    agree = []
    for e, a in zip(expected, actual):
        diff = np.nonzero(e != a)[0]
        agree.append((diff[0] if diff.size else len(e)) / len(e))
    return float(np.mean(agree))
