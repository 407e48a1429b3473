"""Reference modules whose weights stay in their file until they are read.

A *lazy* module is a tfport module whose parameters live on PyTorch's ``meta`` device (a shape and
a dtype, no storage) and carry a loader that reads them from the checkpoint when asked: a GGUF file
(memory-mapped, dequantised one tensor at a time), a safetensors file (read tensor by tensor) or a
tfport checkpoint. Buffers (RoPE frequencies, ALiBi slopes) are computed from the config as usual.

This is what lets an export stream: the exporter reads each weight as it emits it
(``read_weight``), quantises it and writes it to disk, so no more than a few tensors are ever held
in float32; a check that needs a module runs it one piece at a time (``materialized``).

    model = lazy_module(config, {"decoder.layers.0.attn.qkv.weight": load_qkv, ...})
    read_weight(model.decoder.layers[0].attn.qkv.weight)    # float32 numpy [3E, E], read now
    with materialized(model.decoder.layers[0]):             # real tensors inside, meta after
        y = model.decoder.layers[0](x, ...)

Loading a whole model eagerly (``materialize_all``) is the same loaders run for every tensor.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from tfport.config import ModelConfig

Loader = Callable[[], torch.Tensor]
LOADER_ATTR = "_tfport_loader"  # set on a meta parameter: how to read its values


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside goes to the meta device at once (its storage,
    allocated by ``torch.empty`` and never touched, is freed); buffers are computed as usual.
    A parameter registered twice (tied weights) stays the one meta parameter."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def parameter_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical name -> parameter, each parameter once (a tied one under its first name)."""
    seen: dict[int, str] = {}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) not in seen:
            seen[id(param)] = name
            names[name] = param
    return names


def lazy_module(config: ModelConfig, loaders: Mapping[str, Loader] | None = None) -> nn.Module:
    """The module of ``config`` (eval mode) with its parameters on the meta device; ``loaders``
    (canonical parameter name -> a function returning its values, any float dtype) are attached
    with ``attach``. Costs no memory for weights."""
    from . import FAMILY_CLASSES

    with _parameters_on_meta():
        model = FAMILY_CLASSES[config.family](config)
    if loaders is not None:
        attach(model, loaders)
    return model.eval()


def attach(model: nn.Module, loaders: Mapping[str, Loader]) -> None:
    """Attach each loader to the meta parameter of that canonical name; every meta parameter
    must get one (a ``ValueError`` lists those without)."""
    params = parameter_names(model)
    unknown = sorted(set(loaders) - set(params))
    missing = sorted(name for name, p in params.items() if p.is_meta and name not in loaders)
    if unknown or missing:
        raise ValueError(f"lazy weights do not fit the module: no loader for {missing[:12]}, "
                         f"loaders for unknown parameters {unknown[:12]}")
    for name, loader in loaders.items():
        setattr(params[name], LOADER_ATTR, loader)


def is_lazy(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is still on the meta device."""
    return any(p.is_meta for p in model.parameters())


def _load(param: torch.Tensor) -> torch.Tensor:
    """A meta parameter's values from its loader, in its dtype and shape."""
    loader = getattr(param, LOADER_ATTR, None)
    if loader is None:
        raise RuntimeError(f"a weight of shape {list(param.shape)} is on the meta device without a "
                           "loader: a lazy module's weights are read with read_weight or inside "
                           "materialized(...)")
    values = loader().to(param.dtype)  # a reference converted to another dtype reads in it
    if tuple(values.shape) != tuple(param.shape):
        raise RuntimeError(f"a loader gave shape {list(values.shape)} for a weight of shape "
                           f"{list(param.shape)}")
    return values


def read_weight(tensor: torch.Tensor) -> np.ndarray:
    """A weight's values as float32 numpy: read from its file now if it is lazy (the caller holds
    the only copy), else a copy of the tensor's."""
    if tensor.is_meta:
        return _load(tensor).numpy()
    return tensor.detach().float().cpu().numpy()


@contextlib.contextmanager
def materialized(module: nn.Module) -> Iterator[nn.Module]:
    """Inside, ``module``'s lazy parameters hold their real values (read on entry); on exit they
    are meta again and the values are freed. Tied parameters stay tied. Nothing changes for a
    module without lazy parameters."""
    swapped = []
    try:
        swapped = _swap_in(module, lambda p: True)
        yield module
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


def materialize_all(model: nn.Module) -> nn.Module:
    """Read every lazy parameter of ``model`` for good (an eagerly loaded module, float32)."""
    _swap_in(model, lambda p: True, requires_grad=None)
    return model


SMALL_PARAMETER_BYTES = 16 * 2**20  # streamed: parameters outside the layers up to this size are read once
LAYER_PATH = re.compile(r"(.+\.)?layers\.\d+")  # a stack's layer: read whole while it runs


@contextlib.contextmanager
def streamed(model: nn.Module, progress: Callable[[int], object] | None = None) -> Iterator[nn.Module]:
    """Inside, ``model``'s forward runs with its lazy weights read as it goes and freed after:
    each layer (``...layers.N``) reads all of its weights when it runs (a layer's modules may read
    each other's: DeBERTa's attention projects its relative table with its QKV weight) and drops
    them when it returns; each module reads its own the same way where they are not already read
    (the token table, the head; a layer's module called outside the layer's forward, as an
    encoder-decoder's cross-attention keys and values are), except parameters of at most ``SMALL_PARAMETER_BYTES`` (final norms,
    position tables, some read outside their module's forward), read once on entry and kept to
    the end. A forward of a model larger than memory so holds one layer's weights or one table at
    a time, and reads every weight once per forward. ``progress(1)`` is called for each layer or
    module read (a progress bar's ``update``). A no-op for a module without lazy parameters."""
    handles = []
    active: dict[int, contextlib.ExitStack] = {}

    def hooks(module: nn.Module, swap: Callable[[nn.Module], contextlib.AbstractContextManager]) -> None:
        def enter(module: nn.Module, args) -> None:
            reads = progress is not None and any(p.is_meta for p in module.parameters())
            stack = contextlib.ExitStack()
            stack.enter_context(swap(module))
            active[id(module)] = stack
            if reads:  # not a module whose layer has read it already
                progress(1)

        def leave(module: nn.Module, args, output) -> None:
            stack = active.pop(id(module), None)
            if stack is not None:
                stack.close()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    layers = {path: module for path, module in model.named_modules() if LAYER_PATH.fullmatch(path)}
    in_layers = {id(p) for layer in layers.values() for p in layer.parameters()}
    small = _swap_in(model, lambda p: id(p) not in in_layers and p.numel() * p.element_size() <= SMALL_PARAMETER_BYTES)
    try:
        for layer in layers.values():
            if is_lazy(layer):
                hooks(layer, materialized)
        for module in model.modules():  # inside a layer too: a module called outside its layer's forward
            if any(p is not None and p.is_meta for p in module._parameters.values()):
                hooks(module, _own_parameters)
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for stack in active.values():
            stack.close()
        for owner, name, param in small:
            owner._parameters[name] = param


def _swap_in(model: nn.Module, which: Callable[[nn.Parameter], bool],
             requires_grad: bool | None = False) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Read the lazy parameters ``which`` selects into place (tied ones stay one; gradients as
    ``requires_grad`` says, None: as the meta parameter's); returns what to put back: (owner,
    name, meta parameter)."""
    swapped, real = [], {}
    try:
        for owner in model.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None and param.is_meta and which(param):
                    if id(param) not in real:
                        grad = param.requires_grad if requires_grad is None else requires_grad
                        real[id(param)] = nn.Parameter(_load(param), requires_grad=grad)
                    owner._parameters[name] = real[id(param)]
                    swapped.append((owner, name, param))
    except BaseException:  # a read failed: leave the module as it was
        for owner, name, param in swapped:
            owner._parameters[name] = param
        raise
    return swapped


@contextlib.contextmanager
def _own_parameters(module: nn.Module) -> Iterator[None]:
    """``module``'s own (not its children's) lazy parameters real inside."""
    swapped = []
    try:
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(_load(param), requires_grad=False)
                swapped.append((name, param))
        yield
    finally:
        for name, param in swapped:
            module._parameters[name] = param


def wrap_loader(param: nn.Parameter, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make a lazy parameter read as ``transform`` of what it read before (a quantised
    reference's dequantised weights, computed as each is read)."""
    loader = getattr(param, LOADER_ATTR)
    setattr(param, LOADER_ATTR, lambda: transform(loader()))


def lazy_copy(model: nn.Module) -> nn.Module:
    """A copy of a lazy module (still lazy, the same loaders; parameters that are real are
    copied): what a reference with some weights transformed (``wrap_loader``) starts from."""
    import copy

    reference = copy.deepcopy(model).eval()  # deepcopy drops a Parameter's own attributes
    for (name, original), (_, param) in zip(parameter_names(model).items(), parameter_names(reference).items()):
        loader = getattr(original, LOADER_ATTR, None)
        if loader is not None:
            setattr(param, LOADER_ATTR, loader)
    return reference
