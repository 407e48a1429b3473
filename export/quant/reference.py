"""The PyTorch side of a quantised export: a copy of the reference module computing with the
weights the graphs compute with (``fake_quantize``, which asks the scheme: ``reference``), so
that validation and parity against it hold with float32 tolerances.

``dequantized_reference`` is the blockwise schemes' reference: every weight quantised and
dequantised as the graph stores it. ``replaced_weights`` streams the replacement for a lazy
module (``tfport.models.lazy``) as the export does.
"""

from __future__ import annotations

import copy

import numpy as np

from .graph import gatherable


def fake_quantize(model, scheme, dtype: str = "float32"):
    """A copy of ``model`` whose weights are replaced by the values the export with ``scheme``
    computes with (``scheme.reference``): the PyTorch reference a quantised export is compared against."""
    return scheme.reference(model, dtype)


def token_table_paths(model) -> list[str]:
    """Parameter names of the token embedding tables the exporter gathers from."""
    paths = []
    for side in ("encoder", "decoder"):
        stack = getattr(model, side, None)
        if stack is not None and hasattr(stack, "embed"):
            name = f"{side}.embed.tokens.weight"
            if name not in paths and dict(model.named_parameters(remove_duplicate=False)).get(name) is not None:
                paths.append(name)
    return paths


def quantized_weight_names(model, scheme) -> list[str]:
    """Parameter names the export of ``model`` with ``scheme`` quantises: every ``nn.Linear``
    weight (a head tied to a table only with ``scheme.embeddings``) and, with
    ``scheme.embeddings``, the token tables; a tied parameter once."""
    from torch import nn

    tables = token_table_paths(model) if scheme.embeddings else []
    table_ids = {id(model.get_parameter(path)) for path in token_table_paths(model)}
    names, seen = [], set()
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and (id(module.weight) not in table_ids or scheme.embeddings):
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                names.append(f"{path}.weight")
    for path in tables:
        if id(model.get_parameter(path)) not in seen:
            seen.add(id(model.get_parameter(path)))
            names.append(path)
    return names


def dequantized(scheme, rows: np.ndarray, table: bool, dtype: str) -> np.ndarray:
    """``rows`` [out, in] as the export computes with them under ``scheme``: quantised and
    dequantised (a token table only if its codes can be gathered, ``gatherable``; else float, as
    ``WeightQuantizer.table`` stores it). Scales are rounded to ``dtype`` as the graph stores them."""
    quantized = scheme.quantize(rows, dtype)
    if table and not gatherable(quantized):
        return rows
    if scheme.holds(rows):  # keep: the file's blocks are these very values
        return rows
    return quantized.dequantize().astype(np.float32)


def quantized_weights(model, scheme, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Parameter name -> the dequantised value [out, in] (float32) the export of ``model`` with
    ``scheme`` computes with (``quantized_weight_names``, ``dequantized``)."""
    from tfport.models.lazy import read_weight

    tables = set(token_table_paths(model))
    return {name: dequantized(scheme, read_weight(model.get_parameter(name)), name in tables, dtype)
            for name in quantized_weight_names(model, scheme)}


def dequantized_reference(model, scheme, dtype: str = "float32"):
    """A copy of ``model`` whose weights are replaced by their dequantised values (see
    ``quantized_weights``): the reference of a blockwise scheme."""
    tables = set(token_table_paths(model))
    return replaced_weights(model, quantized_weight_names(model, scheme),
                            lambda name, rows: dequantized(scheme, rows, name in tables, dtype))


def replaced_weights(model, names: list[str], transform):
    """A copy of ``model`` whose parameters ``names`` hold ``transform(name, float32 values)``:
    computed now for a loaded module; for a lazy one (``tfport.models.lazy``) each as it is read,
    so a quantised reference of a model larger than memory streams as the model does."""
    import torch

    from tfport.models.lazy import is_lazy, lazy_copy, wrap_loader

    if is_lazy(model):
        reference = lazy_copy(model)
        for name in names:
            wrap_loader(reference.get_parameter(name),
                        lambda values, name=name: torch.from_numpy(transform(name, values.float().numpy())))
        return reference
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for name in names:
            parameter = reference.get_parameter(name)
            value = transform(name, parameter.detach().float().cpu().numpy())
            parameter.copy_(torch.from_numpy(value).to(parameter.dtype))
    return reference
