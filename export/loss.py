"""The loss a quantised layout may cost (``--max-loss``) and how it is measured.

A ``LossBudget`` is at most a value of one metric (``METRICS``): a decoder's perplexity increase
over float32 (the default), the mean KL divergence of its next-token distributions from
float32's, or the share of positions whose top token is not float32's; an encoder's 1 - the
minimum cosine between its quantised and float32 mean-pooled states. ``model_outputs`` runs a
module over the loss text's token sequences, ``loss_measures`` turns a quantised module's outputs
and the float module's into every metric of its family (as ``tfport parity --accuracy`` measures
an export). The search that spends the budget is ``export/budget.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

METRICS = {  # --max-loss NAME=VALUE: what the loss measures (budget.metric in the manifest)
    "perplexity": "perplexity increase",
    "kl": "mean KL divergence",
    "top1": "1 - top-1 agreement",
    "cosine": "1 - minimum cosine",
}
DEFAULT_METRIC = {"decoder": "perplexity", "encoder": "cosine"}  # a bare "10%" or 0.1


@dataclass(frozen=True)
class LossBudget:
    """``--max-loss``: at most ``value`` of ``metric`` (a key of ``METRICS``; None: the model
    family's ``DEFAULT_METRIC``)."""

    value: float
    metric: str | None = None

    def __str__(self) -> str:
        return f"{self.value:g}" if self.metric is None else f"{self.metric}={self.value:g}"

    def metric_for(self, family: str) -> str:
        """The metric measured on a model of ``family``; ``ValueError`` naming ``max_loss`` when
        that family has no such measure (an encoder has no next-token distribution)."""
        metric = self.metric or DEFAULT_METRIC[family]
        allowed = ("cosine",) if family == "encoder" else ("perplexity", "kl", "top1")
        if metric not in allowed:
            raise ValueError(f"max_loss={self}: an {family} model's loss is one of "
                             f"{', '.join(allowed)}")
        return metric


def parse_loss(text: str | float | LossBudget) -> LossBudget:
    """"10%" or 0.1 (the model's default metric), or "kl=0.05" / "top1=5%" / "perplexity=10%" /
    "cosine=0.02" -> a ``LossBudget``; raises ``ValueError`` naming ``max_loss`` unless the
    metric is known and the value positive and finite."""
    if isinstance(text, LossBudget):
        return text
    metric, value = None, text
    if isinstance(text, str) and "=" in text:
        metric, value = (part.strip() for part in text.split("=", 1))
        if metric not in METRICS:
            raise ValueError(f"max_loss={text!r}: expected a metric of {', '.join(METRICS)} before '=', "
                             "e.g. kl=0.05 or top1=5%")
    try:
        number = float(value[:-1]) / 100 if isinstance(value, str) and value.endswith("%") else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"max_loss={text!r}: expected a fraction or a percentage, e.g. 0.1 or 10% "
                         "(or kl=0.05, top1=5%)") from None
    if not number > 0 or number == float("inf"):
        raise ValueError(f"max_loss={text!r}: expected a positive, finite loss")
    return LossBudget(number, metric)


@torch.no_grad()
def model_outputs(model: nn.Module, sequences: list[np.ndarray], reference: list | None = None) -> list:
    """Per sequence, a decoder's ``(next-token log-probabilities [S - 1] in float64, every
    position's log-probabilities [S - 1, V] in float16, their argmax [S - 1])``, or with
    ``reference`` (the float module's ``model_outputs`` of the same sequences) ``(those
    log-probabilities, KL(reference || model) per position, whether the argmax is the
    reference's)``, so that only the reference's distributions are kept (float16: about 1e-3 nats
    of KL; SmolLM2's 3,184 calibration tokens x 49,152: 313 MB); an encoder's mean-pooled last
    states [E]."""
    model = model.eval()
    out = []
    for i, ids in enumerate(sequences):
        x = torch.from_numpy(ids)[None]
        mask = torch.ones_like(x)
        if model.config.family != "decoder":
            out.append(model(x, mask).last_hidden_state[0].double().mean(0))
            continue
        logits, _ = model(x, mask)
        logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)  # [S - 1, V]
        picked = logp.gather(1, x[0, 1:, None])[:, 0]
        if reference is None:
            out.append((picked, logp.half(), logp.argmax(-1)))
            continue
        ref_logp, ref_top = reference[i][1].double(), reference[i][2]
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        out.append((picked, kl, logp.argmax(-1) == ref_top))
    return out


def loss_measures(family: str, reference: list, quantized: list) -> dict[str, float]:
    """A decoder's perplexity increase, mean KL divergence and 1 - top-1 agreement; an
    encoder's 1 - minimum cosine (keys of ``METRICS``)."""
    if family == "decoder":
        nll = lambda parts: -torch.cat([p[0] for p in parts]).mean().item()  # noqa: E731
        return {"perplexity": float(np.exp(nll(quantized) - nll(reference)) - 1),
                "kl": torch.cat([q[1] for q in quantized]).mean().item(),
                "top1": 1.0 - torch.cat([q[2] for q in quantized]).double().mean().item()}
    cosines = [torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in zip(reference, quantized)]
    return {"cosine": 1.0 - min(cosines)}


def describe_measures(measures: dict[str, float]) -> str:
    """The measures for the log: "perplexity +8.1%, KL 0.0612, top-1 84.2%"."""
    if "cosine" in measures:
        return f"1 - cosine {measures['cosine']:.4f}"
    return (f"perplexity {measures['perplexity']:+.2%}, KL {measures['kl']:.4f}, "
            f"top-1 {1 - measures['top1']:.1%}")
