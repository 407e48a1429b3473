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
  (``--max-loss top1=10%``), as ``tfport parity --accuracy`` measures an export; all three are
  recorded for every layout measured, whichever the budget is in (``export/loss.py``);
- an encoder: 1 - the minimum cosine between the quantised and float32 mean-pooled states of the
  loss text's sentences.

The first layout within the budget is the export's, unless a faster layout over it, with its
most sensitive layers at ``PROMOTED_BITS`` (``export/promotion.py``), is within it and still faster
(timed like the others); none within it is an error listing every measured loss. The loss is measured with float activations; the ``ort`` target's int8 activations
add a little (0.1-1% perplexity on SmolLM2). The manifest records the budget, the layout chosen,
its loss and every candidate measured.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from .calibrate import PROMOTED_BITS, PrecomputedQuantization, calibrate, fingerprint, hessian_groups
from .gptq import DAMP
from .hessians import Calibration, collect_hessians, token_sequences
from .loss import METRICS, LossBudget, describe_measures, loss_measures, model_outputs, parse_loss
from .promotion import LayerSwaps, mix, promote_layers
from .quant import QuantScheme, fake_quantize, quantized_weights

log = logging.getLogger(__name__)

BLOCKS = (128, 64, 32)  # candidate block sizes, fewest bytes first
SENSITIVITY_TOKENS = 1024  # of the loss text, to rank layers for promotion (the search reads it all)

# How fast a layout decodes: (a round-to-nearest QuantScheme with the head's bits and block size,
# or a mixed layout's PrecomputedQuantization with None, None) -> tokens/s (encoders: sentences/s).
Speed = Callable[[QuantScheme | PrecomputedQuantization, int | None, int | None], float]


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


@dataclass(frozen=True)
class LayoutSearch:
    """What ``choose_layout`` reads and may vary: the model's ``tokenizer`` (a tokenizer.json),
    the ``calibration`` text GPTQ runs on (None: round-to-nearest), the ``loss_text`` the loss is
    measured on (None: the calibration text); ``block_size`` / ``head_bits`` fix those fields of
    every candidate when not None; ``head_block_size``: the head's and token table's blocks
    (None: ``calibrate.head_block``); ``scale_dtype``: the scales' dtype; ``threads``: matrices
    GPTQ quantises at once (``calibrate``)."""

    tokenizer: str | os.PathLike | None
    calibration: Calibration | None = None
    loss_text: str | os.PathLike | None = None
    block_size: int | None = None
    head_bits: int | None = None
    head_block_size: int | None = None
    scale_dtype: str = "float32"
    threads: int | None = None


def choose_layout(model: nn.Module, scheme: QuantScheme, max_loss: float | LossBudget, search: LayoutSearch,
                  speed: Speed) -> PrecomputedQuantization:
    """The fastest layout of ``scheme``'s format (its symmetry) whose loss is at most
    ``max_loss`` (a ``LossBudget``, or a float in the family's default metric; module doc),
    quantised as ``search`` says (GPTQ on its calibration text, or round-to-nearest), with the
    budget recorded. ``speed`` times a candidate (``Speed``; the exporter's: a round-to-nearest
    export of it, decoded under the runtime)."""
    budget = parse_loss(max_loss)
    tokenizer, calibration, scale_dtype = search.tokenizer, search.calibration, search.scale_dtype
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
    loss_source = Calibration(search.loss_text) if search.loss_text else (calibration or Calibration())
    loss_sequences = token_sequences(loss_source.read(), text_tokenizer, model.config, loss_source.tokens)
    sequences, hessians, record = None, {}, {}
    if calibration is not None:
        sequences = token_sequences(calibration.read(), text_tokenizer, model.config, calibration.tokens)
        linear = [f"{path}.weight" for path, m in model.named_modules() if isinstance(m, nn.Linear)]
        # Hessians kept for every layout when they fit the budget; else collected per layout, in groups
        hessians = collect_hessians(model, sequences) if len(hessian_groups(model, linear)) == 1 else None
        record = {"method": "gptq", "damp": DAMP, "calibration": calibration.to_dict()}
    layouts = candidates(scheme, search.block_size, search.head_bits)
    for layout in layouts:
        layout.per_s = speed(QuantScheme(scheme.bits, layout.block_size, scheme.symmetric),
                             layout.head_bits, search.head_block_size)
        log.info("max_loss: %s decodes %.1f/s", layout.name, layout.per_s)
    reference = model_outputs(model, loss_sequences)

    def measure(module: nn.Module, count: int = len(loss_sequences)) -> dict[str, float]:
        """Every metric of ``module`` on the first ``count`` loss sequences."""
        return loss_measures(family, reference[:count],
                             model_outputs(module, loss_sequences[:count], reference[:count]))

    def quantize(layout: Candidate, bits: int | None = None) -> PrecomputedQuantization:
        layout_scheme = QuantScheme(bits or scheme.bits, layout.block_size, scheme.symmetric, scheme.embeddings)
        return calibrate(model, layout_scheme, sequences if hessians is None else hessians, scale_dtype,
                         layout.head_bits, record=dict(record), threads=search.threads,
                         head_block_size=search.head_block_size)

    def quantize_and_measure(layout: Candidate) -> PrecomputedQuantization:
        quantization = quantize(layout)
        layout.measures = measure(fake_quantize(model, quantization, scale_dtype))
        layout.loss = layout.measures[metric]
        log.info("max_loss: %s loses %s", layout.name, describe_measures(layout.measures))
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
                     describe_measures(measured), "" if count == len(loss_sequences) else f" (first {count} sequences)")
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
        candidate.per_s = speed(mixed, None, None)
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
