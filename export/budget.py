"""``--quantize int4 --max-loss 10%``: the fastest quantised layout whose measured loss stays
within a budget, chosen by measuring, not by a table.

The candidates are the format's layouts by block size (128, 64, 32) and head precision (the
format's bits, then the LM head and token table at 8 bits, as llama.cpp's Q4_K_M keeps its output
tensor). Each candidate's decode speed is measured on this machine: a round-to-nearest export of
that layout (the codes do not change the speed), batch 1, the median step of a few greedy runs
(an encoder: a batch of sentences). Then, fastest first, each layout is quantised as the export
would be (GPTQ on the calibration text's Hessians, collected once when they fit
``calibrate.HESSIAN_BUDGET``, else per layout in groups; round-to-nearest with ``calibration=None``)
and its loss measured on the module holding the dequantised weights:

- a decoder: on the loss text (the calibration text unless ``loss_text`` names another file),
  in sequences of up to 512 tokens, the perplexity increase over float32 (the default,
  ``--max-loss 10%``), the mean KL divergence of the next-token distributions from float32's
  (``--max-loss kl=0.05``, nats) or the share of positions whose top token is not float32's
  (``--max-loss top1=10%``), as ``parity/accuracy.py`` measures an export; all three are
  recorded for every layout measured, whichever the budget is in;
- an encoder: 1 - the minimum cosine between the quantised and float32 mean-pooled states of the
  loss text's sentences.

The first layout within the budget is the export's, unless a faster layout over it, with its
most sensitive layers at ``PROMOTED_BITS`` (``promote_layers``), is within it and still faster
(timed like the others); none within it is an error listing every measured loss. The loss is measured with float activations; the ``ort`` target's int8 activations
add a little (0.1-1% perplexity on SmolLM2). The manifest records the budget, the layout chosen,
its loss and every candidate measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .calibrate import PROMOTED_BITS, PrecomputedQuantization, calibrate, fingerprint, hessian_groups, in_order, layer_of
from .gptq import DAMP
from .hessians import Calibration, collect_hessians, token_sequences
from .quant import QuantScheme, fake_quantize, quantized_weights
from .row_index import RowIndex

log = logging.getLogger(__name__)

BLOCKS = (128, 64, 32)  # candidate block sizes, fewest bytes first
SENSITIVITY_TOKENS = 1024  # of the loss text, to rank layers for promotion (the search reads it all)
SPEED_STEPS, SPEED_REPEATS = 16, 3


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


@dataclass
class Candidate:
    """One layout: its block size and head bits, the measured speed and (once measured) loss."""

    block_size: int
    head_bits: int | None
    per_s: float = 0.0  # decode tokens/s (encoders: sentences/s)
    loss: float | None = None  # in the budget's metric
    promoted: tuple[str, ...] = ()  # layers whose matrices are at PROMOTED_BITS
    measures: dict[str, float] = dataclasses.field(default_factory=dict)  # every metric measured

    @property
    def name(self) -> str:
        return (f"blocks of {self.block_size}" + (f", head int{self.head_bits}" if self.head_bits else "")
                + (f", {len(self.promoted)} layer{'s' * (len(self.promoted) > 1)} int{PROMOTED_BITS}"
                   if self.promoted else ""))

    def to_dict(self) -> dict:
        out = {"block_size": self.block_size, "head_bits": self.head_bits, "per_s": round(self.per_s, 2),
               "loss": None if self.loss is None else float(f"{self.loss:.4g}"),
               **{name: float(f"{value:.4g}") for name, value in self.measures.items()}}
        return {**out, "promoted": list(self.promoted)} if self.promoted else out


def candidates(scheme: QuantScheme, block_size: int | None, head_bits: int | None) -> list[Candidate]:
    """The layouts to measure: ``block_size`` / ``head_bits`` when the user fixed them."""
    blocks = BLOCKS if block_size is None else (block_size,)
    heads = (None, 8) if head_bits is None and scheme.bits == 4 else (head_bits,)
    return [Candidate(b, h) for h in heads for b in blocks]


def choose_layout(model: nn.Module, scheme: QuantScheme, max_loss: float | LossBudget, tokenizer,
                  calibration: Calibration | None, loss_text: str | None, block_size: int | None,
                  head_bits: int | None, target, scale_dtype: str = "float32",
                  threads: int | None = None, head_block_size: int | None = None) -> PrecomputedQuantization:
    """The fastest layout of ``scheme``'s format (its symmetry) whose loss is at most
    ``max_loss`` (a ``LossBudget``, or a float in the family's default metric; module doc),
    quantised (GPTQ on ``calibration``, or round-to-nearest when None,
    ``threads`` matrices at once: ``calibrate``), with the budget recorded. ``block_size`` /
    ``head_bits`` fix those fields when not None; the head and token table are in blocks of
    ``head_block_size`` (None: ``calibrate.head_block``)."""
    budget = parse_loss(max_loss)
    if model.config.family not in ("decoder", "encoder"):
        raise ValueError(f"max_loss={budget}: measures a decoder's next tokens or an encoder's cosine; "
                         f"this is an {model.config.family} model (quantise it with a fixed layout)")
    if tokenizer is None:
        raise ValueError(f"max_loss={budget}: measuring the loss reads a text, which needs the "
                         "model's tokenizer (tokenizer=PATH; tfport export --tokenizer)")
    family, metric = model.config.family, budget.metric_for(model.config.family)
    show = (lambda v: f"{v:.4f} nats") if metric == "kl" else (lambda v: f"{v:.3%}")  # noqa: E731
    max_loss = budget.value
    from tokenizers import Tokenizer

    text_tokenizer = Tokenizer.from_file(str(tokenizer))
    loss_source = Calibration(loss_text) if loss_text else (calibration or Calibration())
    loss_sequences = token_sequences(loss_source.read(), text_tokenizer, model.config, loss_source.tokens)
    sequences, hessians, record = None, {}, {}
    if calibration is not None:
        sequences = token_sequences(calibration.read(), text_tokenizer, model.config, calibration.tokens)
        linear = [f"{path}.weight" for path, m in model.named_modules() if isinstance(m, nn.Linear)]
        # Hessians kept for every layout when they fit the budget; else collected per layout, in groups
        hessians = collect_hessians(model, sequences) if len(hessian_groups(model, linear)) == 1 else None
        record = {"method": "gptq", "damp": DAMP, "calibration": calibration.to_dict()}
    layouts = candidates(scheme, block_size, head_bits)
    for layout in layouts:
        layout.per_s = _speed(model, QuantScheme(scheme.bits, layout.block_size, scheme.symmetric),
                              layout.head_bits, target, head_block_size)
        log.info("max_loss: %s decodes %.1f/s", layout.name, layout.per_s)
    reference = _outputs(model, loss_sequences)

    def measure(module: nn.Module, count: int = len(loss_sequences)) -> dict[str, float]:
        """Every metric of ``module`` on the first ``count`` loss sequences."""
        return _measures(family, reference[:count], _outputs(module, loss_sequences[:count], reference[:count]))

    def quantize(layout: Candidate, bits: int | None = None) -> PrecomputedQuantization:
        layout_scheme = QuantScheme(bits or scheme.bits, layout.block_size, scheme.symmetric, scheme.embeddings)
        return calibrate(model, layout_scheme, sequences, scale_dtype, layout.head_bits,
                         record=dict(record), hessians=hessians, threads=threads, head_block_size=head_block_size)

    def quantize_and_measure(layout: Candidate) -> PrecomputedQuantization:
        quantization = quantize(layout)
        layout.measures = measure(fake_quantize(model, quantization, scale_dtype))
        layout.loss = layout.measures[metric]
        log.info("max_loss: %s loses %s", layout.name, _describe(layout.measures))
        return quantization

    highs: dict[int, PrecomputedQuantization] = {}  # block size -> every matrix at PROMOTED_BITS
    everything: dict[str, float] = {}  # layout name -> its loss with every layer promoted

    def promote(layout: Candidate, base: PrecomputedQuantization) -> tuple[Candidate, PrecomputedQuantization] | None:
        """``layout`` (over the budget) with its most sensitive layers at PROMOTED_BITS, as few as
        keep the loss within it and timed, or None when all of them do not."""
        if layout.block_size not in highs:  # the layers' 8-bit codes do not depend on the head's bits
            highs[layout.block_size] = quantize(layout, PROMOTED_BITS)
        high = highs[layout.block_size]
        swaps = LayerSwaps(fake_quantize(model, base, scale_dtype), quantized_weights(model, high, scale_dtype))

        measures: dict[frozenset, dict[str, float]] = {}  # promoted layers -> every metric, whole text

        def loss_of(layers: tuple[str, ...], count: int = len(loss_sequences)) -> float:
            """The loss with ``layers`` promoted, on the first ``count`` loss sequences."""
            with swaps(layers) as module:
                measured = measure(module, count)
            if count == len(loss_sequences):
                measures[frozenset(layers)] = measured
            log.info("max_loss: %s with %s int%d loses %s%s", layout.name,
                     layers[0] if len(layers) == 1 else f"{len(layers)} layers", PROMOTED_BITS,
                     _describe(measured), "" if count == len(loss_sequences) else f" (first {count} sequences)")
            return measured[metric]

        lengths = np.cumsum([len(ids) for ids in loss_sequences])  # rank layers on a shorter text
        ranked = max(1, int(np.searchsorted(lengths, SENSITIVITY_TOKENS, side="right")))
        layers, loss = promote_layers(swaps.layers, loss_of, max_loss, lambda layer: loss_of((layer,), ranked))
        if layers is None:  # loss: with every layer promoted, for the error if no layout passes
            everything[layout.name] = loss
            return None
        mixed = mix(base, high, layers)
        candidate = dataclasses.replace(layout, promoted=layers, loss=loss,
                                        measures=measures[frozenset(layers)])
        candidate.per_s = _speed(model, mixed, None, target)
        log.info("max_loss: %s decodes %.1f/s", candidate.name, candidate.per_s)
        return candidate, mixed

    try:
        chosen_layout, chosen = pick(layouts, quantize_and_measure, max_loss, scheme.name,
                                     promote if scheme.bits < PROMOTED_BITS else None, show)
    except ValueError as err:
        if not everything:
            raise
        raise ValueError(f"{err}; with every layer int{PROMOTED_BITS}: "
                         + "; ".join(f"{name}: {show(loss)}" for name, loss in everything.items())) from None
    chosen.record["budget"] = {"max_loss": max_loss, "loss": float(f"{chosen_layout.loss:.4g}"),
                               "metric": METRICS[metric], "text": loss_source.to_dict()["text"],
                               "candidates": [c.to_dict() for c in layouts]}
    chosen.record["sha256"] = fingerprint(chosen.index)
    return chosen


def pick(layouts: list[Candidate], quantize: Callable[[Candidate], Any], max_loss: float, name: str,
         promote: Callable[[Candidate, Any], tuple[Candidate, Any] | None] | None = None,
         show: Callable[[float], str] = lambda loss: f"{loss:.3%}") -> tuple:
    """(layout, its quantisation): fastest first, ``quantize(layout)`` sets ``layout.loss``; the
    first within ``max_loss`` wins, unless a faster layout over the budget, ``promote``d (its
    sensitive layers at more bits: a new, timed candidate appended to ``layouts``), is within it
    and faster still. Raises ``ValueError`` listing every measured loss (``show`` writes one) if
    none is."""
    best = None  # (candidate, quantisation): the fastest within the budget so far
    for layout in sorted(layouts, key=lambda c: -c.per_s):
        if best is not None and best[0].per_s >= layout.per_s:
            break
        quantization = quantize(layout)
        if layout.loss <= max_loss:  # faster than best, or the loop would have stopped
            return layout, quantization
        mixed = promote(layout, quantization) if promote is not None else None
        if mixed is not None:
            layouts.append(mixed[0])
            if best is None or mixed[0].per_s > best[0].per_s:
                best = mixed
    if best is not None:
        return best
    raise ValueError(f"max_loss={show(max_loss)}: no {name} layout stays within it on this model; measured: "
                     + "; ".join(f"{c.name}: {show(c.loss)}" for c in layouts))


def mix(base: PrecomputedQuantization, high: PrecomputedQuantization,
        layers: tuple[str, ...]) -> PrecomputedQuantization:
    """``base`` with the matrices of ``layers`` taken from ``high`` (``calibrate`` on the same
    module: matched by position, the same GPTQ, so the codes ``calibrate(promoted=layers)``
    gives, without quantising again), recorded as promoted."""
    if high.names != base.names or len(base.names) != len(base.index.matrices):
        raise ValueError("mix: the two quantisations must come from calibrate on the same module")
    unknown = set(layers) - {layer_of(name) for name in base.names}
    if unknown:
        raise ValueError(f"layers={sorted(unknown)!r}: not layers with weight matrices in this model")
    index = RowIndex()
    for name, low, high_matrix, keys in zip(base.names, base.index.matrices, high.index.matrices, base.index.keys):
        index.add_keys(keys, high_matrix if layer_of(name) in layers else low)
    record = {**base.record, "promoted": list(in_order(layers))}
    mixed = PrecomputedQuantization(base.scheme, index, base.scale_dtype, record, base.names)
    mixed.record["sha256"] = fingerprint(index)
    return mixed


class LayerSwaps:
    """One dequantised copy of a model (``module``) whose layers' weights can be swapped for
    other values (``high``: parameter name -> [out, in], as ``quantized_weights`` gives) and
    back: a mixture's loss without a copy of the model per mixture."""

    def __init__(self, module: nn.Module, high: dict[str, np.ndarray]):
        self.module = module
        self.high = {name: value for name, value in high.items() if layer_of(name) is not None}
        self.layers = in_order({layer_of(name) for name in self.high})

    @contextlib.contextmanager
    def __call__(self, layers: tuple[str, ...]):
        names = [name for name in self.high if layer_of(name) in layers]
        kept = {}
        with torch.no_grad():
            try:
                for name in names:
                    parameter = self.module.get_parameter(name)
                    kept[name] = parameter.detach().clone()
                    parameter.copy_(torch.from_numpy(self.high[name]).to(parameter.dtype))
                yield self.module
            finally:
                for name, value in kept.items():
                    self.module.get_parameter(name).copy_(value)


def promote_layers(layers: tuple[str, ...], loss_of: Callable[[tuple[str, ...]], float],
                   max_loss: float, alone: Callable[[str], float] | None = None
                   ) -> tuple[tuple[str, ...] | None, float]:
    """(the fewest ``layers`` whose promotion brings the loss (``loss_of``) within ``max_loss``,
    that loss), most sensitive first: a layer's sensitivity is the loss with it alone promoted
    (``alone``, default ``loss_of``; on a shorter text it ranks the same for less); then 1, 2,
    4, ... of them are tried and the last interval bisected. (None, the loss with every layer
    promoted) if that is not enough; (None, nan) without layers."""
    if not layers:
        return None, float("nan")
    alone = alone or (lambda layer: loss_of((layer,)))
    sensitivity = {layer: alone(layer) for layer in layers}
    order = sorted(layers, key=lambda name: sensitivity[name])  # the lowest loss alone: the most sensitive

    def within(count: int) -> float | None:
        nonlocal last
        last = loss_of(tuple(order[:count]))
        return last if last <= max_loss else None

    last = float("nan")  # the loss within() measured last
    low, count = 0, 1  # low layers fail; count is the next try
    loss = within(count)
    while loss is None:
        if count == len(order):
            return None, last
        low, count = count, min(2 * count, len(order))
        loss = within(count)
    while count - low > 1:  # count layers pass, low fail
        middle = (low + count) // 2
        better = within(middle)
        if better is not None:
            loss, count = better, middle
        else:
            low = middle
    return in_order(order[:count]), loss


@torch.no_grad()
def _outputs(model: nn.Module, sequences: list[np.ndarray], reference: list | None = None) -> list:
    """Per sequence, a decoder's ``(next-token log-probabilities [S - 1] in float64, every
    position's log-probabilities [S - 1, V] in float16, their argmax [S - 1])``, or with
    ``reference`` (the float module's ``_outputs`` of the same sequences) ``(those
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


def _measures(family: str, reference: list, quantized: list) -> dict[str, float]:
    """A decoder's perplexity increase, mean KL divergence and 1 - top-1 agreement; an
    encoder's 1 - minimum cosine (keys of ``METRICS``)."""
    if family == "decoder":
        nll = lambda parts: -torch.cat([p[0] for p in parts]).mean().item()  # noqa: E731
        return {"perplexity": float(np.exp(nll(quantized) - nll(reference)) - 1),
                "kl": torch.cat([q[1] for q in quantized]).mean().item(),
                "top1": 1.0 - torch.cat([q[2] for q in quantized]).double().mean().item()}
    cosines = [torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in zip(reference, quantized)]
    return {"cosine": 1.0 - min(cosines)}


def _describe(measures: dict[str, float]) -> str:
    """The measures for the log: "perplexity +8.1%, KL 0.0612, top-1 84.2%"."""
    if "cosine" in measures:
        return f"1 - cosine {measures['cosine']:.4f}"
    return (f"perplexity {measures['perplexity']:+.2%}, KL {measures['kl']:.4f}, "
            f"top-1 {1 - measures['top1']:.1%}")


def _speed(model: nn.Module, scheme: QuantScheme | PrecomputedQuantization, head_bits: int | None,
           target, head_block_size: int | None = None) -> float:
    """Decode tokens/s (encoders: sentences/s) of a round-to-nearest export of this layout (or of
    the precomputed quantisation of a mixed one: the codes do not change the speed)."""
    from tfport.runtime import load_model

    from .exporter import export_model
    from .options import ExportOptions

    config = model.config
    with tempfile.TemporaryDirectory(prefix="tfport-max-loss-") as tmp:
        out = Path(tmp) / "candidate"
        export_model(model, out, ExportOptions(target=target, quantize=scheme, calibration="none",
                                               head_bits=head_bits, head_block_size=head_block_size,
                                               validate=False))
        runtime = load_model(out)
        rng = np.random.default_rng(0)
        if config.family == "decoder":
            from .bench.measurement import time_tfport

            prompt = rng.integers(min(100, config.vocab_size // 2), config.vocab_size, size=(1, 16))
            time_tfport(runtime, prompt, 2)  # warm-up
            steps = [statistics.median(time_tfport(runtime, prompt, SPEED_STEPS).step_ms)
                     for _ in range(SPEED_REPEATS)]
            return 1e3 / statistics.median(steps)
        batch = rng.integers(min(100, config.vocab_size // 2), config.vocab_size, size=(8, 64))
        runtime.encode(batch)  # warm-up
        times = []
        for _ in range(SPEED_REPEATS):
            start = time.perf_counter()
            runtime.encode(batch)
            times.append(time.perf_counter() - start)
        return len(batch) / statistics.median(times)
