"""Mixed precision within a loss budget: a layout's most sensitive layers at ``PROMOTED_BITS``.

``promote_layers`` finds the fewest layers whose promotion brings the loss within the budget
(most sensitive first, then 1, 2, 4, ... of them and a bisection); ``LayerSwaps`` measures a
mixture on one dequantised copy of the model, swapping layers' weights in and out; ``mix``
assembles the mixture's codes from two ``calibrate`` runs on the same module, the codes
``calibrate(promoted=layers)`` gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from .calibrate import PrecomputedQuantization, fingerprint, in_order, layer_of
from .row_index import RowIndex


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
