"""Localisation: when a case fails, compare the graph's taps with the reference's intermediates
and name the first layer and piece (rotary, bias, attention, FFN, norm) that diverges.

Each graph records its taps (graph value per reference module path) in its metadata; the
reference's values are captured with forward hooks on the same module paths (including the
``Tap`` points inside attention and each stack).
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from tfport.dtypes import ONNX_DTYPES
from tfport.models.attention import Attention, Tap
from tfport.models.layers import Block, FeedForward, RMSNorm
from tfport.models.stack import Embeddings

from ..graph import TAPS_KEY
from .cases import Case, Diff, _compare
from .runner import Runner

CAPTURED = (Embeddings, RMSNorm, nn.LayerNorm, FeedForward, Attention, Block, Tap)


@contextmanager
def capture(model: nn.Module):
    """Collect the outputs of the reference's norms, attention, FFNs, blocks and taps by module
    path: yields a dict filled during the forward, ``{"decoder.layers.0.ffn": tensor, ...}``."""
    captured: dict[str, torch.Tensor] = {}

    def hook(path):
        def store(module, args, output):
            captured[path] = output[0] if isinstance(output, tuple) else output
        return store

    handles = [module.register_forward_hook(hook(path)) for path, module in model.named_modules()
               if isinstance(module, CAPTURED)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def tap_session(runner: Runner, graph: str) -> tuple[ort.InferenceSession, dict[str, tuple[str, str]]]:
    """A session of ``graph`` whose outputs also include every recorded tap, run as the runner
    runs the graph itself (a quantised export's products at float activations: the taps are
    compared with the fake-quantised reference's intermediates, as the outputs are)."""
    proto = runner.graph_model(graph)
    props = {p.key: p.value for p in proto.metadata_props}
    taps = json.loads(props.get(TAPS_KEY, "{}"))
    existing = {o.name for o in proto.graph.output}
    for value, dtype in taps.values():
        if value not in existing:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(value, ONNX_DTYPES[dtype], None))
            existing.add(value)
    return runner.open(proto), taps


@torch.no_grad()
def localize(runner: Runner, case: Case) -> list[Diff]:
    """Compare every tapped intermediate of every graph of ``case`` in graph order.

    Returns the diffs in order; ``first_divergence`` names the first that fails.
    """
    diffs = []
    for prepared in runner.prepare(case):
        session, taps = tap_session(runner, prepared.graph)
        actual = runner.run_onnx(prepared, session)
        with capture(runner.model) as captured:
            prepared.reference()
        exact: dict[str, torch.Tensor] = {}
        if runner.float64_reference() is not None:  # each tap's float32 rounding floor
            with capture(runner.float64_reference()) as exact:
                prepared.reference(runner.float64_reference())
        for point, (value, _) in taps.items():
            if point not in captured:
                continue
            expected = captured[point].float().numpy()
            real = runner._real(point, expected, prepared)
            diffs.append(_compare(point, expected, actual[value].astype(np.float32), real, runner.tolerance,
                                  floor=runner.rounding_floor(captured[point], exact.get(point), real)))
    return diffs


PIECES = (("rotary_", "rotary"), ("content_term", "disentangled position bias"), ("context", "attention"), ("attn_norm", "norm"), ("cross_norm", "norm"),
          ("ffn_norm", "norm"), ("attn", "attention output"), ("cross_attn", "cross-attention"),
          ("ffn", "FFN"), ("bias", "mask / position bias (ALiBi, relative)"), ("embed", "embeddings"),
          ("norm", "final norm"))


def first_divergence(diffs: list[Diff]) -> str | None:
    """'layer 3 of decoder, rotary (decoder.layers.3.attn.rotary_q): max_abs=...' or None."""
    for diff in diffs:
        if diff.ok:
            continue
        parts = diff.output.split(".")
        last = parts[-1]
        piece = next((label for key, label in PIECES if last.startswith(key)), "block output")
        where = f"layer {parts[2]} of {parts[0]}" if len(parts) > 2 and parts[1] == "layers" else parts[0]
        return f"{where}, {piece} ({diff.output}): max_abs={diff.max_abs:.3g} max_rel={diff.max_rel:.3g}"
    return None
