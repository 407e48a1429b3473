"""The PyTorch reference an export is compared with: the module in the export's dtype, with its
KV cache rounded to the export's cache dtype.

* ``dtype`` float16 / bfloat16: a converted copy (never the caller's weights), except the
  buffers the graphs keep in float32 whatever the dtype (rotary frequencies, ALiBi slopes:
  ``FLOAT32_BUFFERS``), so both sides compute rotary angles from the same float32 frequencies.
* ``kv_dtype`` other than the module's dtype (``--kv-dtype float16`` on a float32 model): forward
  hooks round the decoder's new keys and values to it as they enter the cache
  (``Attention.cached_k`` / ``cached_v``) and its cross-attention keys and values as they are
  projected (the encoder graph returns them in the cache dtype), which is what the graph does (``PortableTarget.append_to_cache``): a step attends to the values later steps read.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tfport.models.lazy import is_lazy, lazy_copy

from tfport.models.attention import Attention

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Buffers the graphs store as float32 for every export dtype (export/targets, export/positions).
FLOAT32_BUFFERS = ("inv_freq", "local_inv_freq", "long_inv_freq", "alibi_slopes")


def _round_to(dtype: torch.dtype):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype).to(output.dtype)
    return hook


def reference_module(model: nn.Module, dtype: str = "float32", kv_dtype: str | None = None) -> nn.Module:
    """``model`` as an export of ``dtype`` with a ``kv_dtype`` cache computes it: ``model`` itself
    for float32 with a float32 cache, else a copy (see the module docstring)."""
    torch_dtype = TORCH_DTYPES[dtype]
    rounding = kv_dtype is not None and TORCH_DTYPES[kv_dtype] != torch_dtype
    if torch_dtype == torch.float32 and not rounding:
        return model
    reference = (lazy_copy(model) if is_lazy(model) else copy.deepcopy(model)).to(torch_dtype)
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1] in FLOAT32_BUFFERS:
            module_name, _, attribute = name.rpartition(".")
            setattr(reference.get_submodule(module_name), attribute, buffer.detach().clone().float())
    if rounding:
        hook = _round_to(TORCH_DTYPES[kv_dtype])
        for path, module in reference.named_modules():
            if not isinstance(module, Attention) or not path.startswith("decoder."):
                continue  # an encoder's self-attention keeps no cache
            points = (module.kv,) if module.cross else (module.cached_k, module.cached_v)
            for point in points:
                point.register_forward_hook(hook)
    return reference.eval()
