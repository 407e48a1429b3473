"""Loading a family's tensors into a tfport module: a strict plan first, then the copy.

The tensors come from any ``TensorSource`` presenting Hugging Face names (``weights`` reads a
safetensors checkpoint; other formats bring their own source). Loading is strict: every tfport
tensor must be found with the expected shape, and every HF tensor must be used, listed as a tied
copy, or listed in the architecture's ``ignored`` with the reason it is unused; all problems are
reported together before anything is read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from tfport.config import ModelConfig

from ..checkpoint import _aliases
from .rules import Architecture, Rule, Shape
from .weights import MAX_LISTED

log = logging.getLogger(__name__)


class TensorSource(Protocol):
    """Named tensors of one checkpoint, under their Hugging Face names, read on demand.

    ``keys()``: every tensor name, as ``transformers``' state dict names it -- the task model's
    (``model.layers.0.self_attn.q_proj.weight``) or the base model's, without the prefix
    (``layers.0.self_attn.q_proj.weight``). ``shape(name)``: its shape in that state dict's layout
    (``nn.Linear`` weights [out, in]), read without loading the tensor. ``get(name)``: the tensor,
    any floating dtype (converted to float32 here; dequantise before). ``where(name)``: where it
    is, for messages (``model.safetensors: model.norm.weight``).
    """

    def keys(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def where(self, name: str) -> str: ...


class _Normalized:
    """A source under the names the rules use (``Architecture.normalize``), as float32."""

    def __init__(self, tensors: TensorSource, arch: Architecture, origin: str):
        self.tensors = tensors
        self.original: dict[str, str] = {}  # normalized name -> name in the source
        self._stacks: dict[str, torch.Tensor] = {}  # the last two expert stacks read (``stack``)
        for key in sorted(tensors.keys()):
            name = arch.normalize(key)
            if name in self.original:
                raise ValueError(f"{origin}: {tensors.where(self.original[name])} and {tensors.where(key)} "
                                 f"are both {name!r} (with and without the prefix {arch.base_prefix!r})")
            self.original[name] = key

    def __contains__(self, name: str) -> bool:
        return name in self.original

    def keys(self) -> frozenset[str]:
        return frozenset(self.original)

    def where(self, name: str) -> str:
        return self.tensors.where(self.original[name])

    def shape(self, name: str) -> Shape:
        return tuple(self.tensors.shape(self.original[name]))

    def get(self, name: str) -> torch.Tensor:
        return self.tensors.get(self.original[name]).float()

    def stack(self, name: str) -> torch.Tensor:
        """``get(name)`` of a tensor stacking every expert's [N, ...], kept while it is one of
        the last two read (a layer's experts read their slices of its two stacks in turn)."""
        if name not in self._stacks:
            self._stacks = {**dict(list(self._stacks.items())[-1:]), name: self.get(name)}
        return self._stacks[name]


@dataclass
class _Plan:
    """What loading found: per tfport tensor its sources, and every problem."""

    loads: list[tuple[str, Rule, tuple[str, ...]]] = field(default_factory=list)
    tied: list[tuple[str, str, Rule, tuple[str, ...]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)


def _plan(model: nn.Module, arch: Architecture, tensors: _Normalized) -> _Plan:
    config: ModelConfig = model.config
    canonical, aliases = _aliases(model)
    plan = _Plan()

    def sources(target: str, shape: Shape) -> tuple[Rule, tuple[str, ...], bool]:
        rule, groups = arch.rule(target, config, tensors.__contains__)
        names = tuple(s.format(**groups) for s in rule.sources)
        ok = True
        shapes = rule.transform.shapes(shape, config)
        if rule.stacked:  # every expert's, stacked on dim 0
            shapes = [(config.moe.n_experts, *expected) for expected in shapes]
        for name, expected in zip(names, shapes):
            if name not in tensors:
                ok = False
                plan.missing.append(f"{name} (for {target})")
            elif tensors.shape(name) != tuple(expected):
                ok = False
                plan.mismatched.append(f"{tensors.where(name)} has shape {tensors.shape(name)}, "
                                       f"expected {tuple(expected)} (for {target}: "
                                       f"{rule.transform.name})")
            plan.used.add(name)
        return rule, names, ok

    for target, tensor in canonical.items():
        rule, names, ok = sources(target, tuple(tensor.shape))
        if ok:
            plan.loads.append((target, rule, names))
    for alias, target in aliases.items():  # tied copies HF may or may not have saved
        rule, groups = arch.rule(alias, config, tensors.__contains__)
        names = tuple(s.format(**groups) for s in rule.sources)
        if names and all(name in tensors for name in names):
            rule, names, ok = sources(alias, tuple(canonical[target].shape))
            if ok:
                plan.tied.append((alias, target, rule, names))
    return plan


def _problems(plan: _Plan, arch: Architecture, tensors: _Normalized) -> list[str]:
    ignored = [re.compile(pattern + "$") for pattern in arch.ignored]
    duplicates = {copy for copy, original in arch.duplicates.items()
                  if copy in tensors and original in plan.used}
    unexpected = sorted(
        f"{tensors.where(name)} {tensors.shape(name)}" for name in tensors.keys()
        if name not in plan.used and name not in duplicates
        and not any(p.match(name) for p in ignored))

    def listed(items: list[str]) -> str:
        more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
        return "; ".join(items[:MAX_LISTED]) + more

    problems = []
    if plan.missing:
        problems.append(f"missing key(s): {listed(plan.missing)}")
    if unexpected:
        problems.append(f"unexpected key(s): {listed(unexpected)} (ignored on purpose: "
                        f"{sorted(arch.ignored) or 'none'})")
    if plan.mismatched:
        problems.append(f"shape mismatch(es): {listed(plan.mismatched)}")
    return problems


def _build(target: str, rule: Rule, names: tuple[str, ...], shape: Shape, config: ModelConfig,
           tensors: _Normalized) -> torch.Tensor:
    if rule.stacked:  # expert {e}'s slice of each stack (read once for all its experts)
        expert = int(rule.pattern.match(target).group("e"))
        inputs = [tensors.stack(name)[expert] for name in names]
    else:
        inputs = [tensors.get(name) for name in names]
    out = rule.transform.apply(inputs, shape, config)
    assert tuple(out.shape) == shape, (rule, tuple(out.shape), shape)
    return out


def load(arch: Architecture, hf: dict, source: TensorSource, origin: str, lazy: bool = False) -> nn.Module:
    """The module of ``arch`` for HF config ``hf`` with ``source``'s tensors (eval mode, float32).

    With ``lazy``, its parameters stay on the meta device, each read from ``source`` when it is
    used (``tfport.models.lazy``): nothing but the plan is read now. Eager loading is the same
    readers run for every tensor.

    Raises ``ValueError`` starting with ``origin`` when the tensors do not map onto the module
    (missing, unexpected, mis-shaped), or (when the tensor is read) a tied copy differs from its
    original.
    """
    from ..lazy import attach, lazy_module, materialize_all

    tensors = _Normalized(source, arch, origin)
    config = arch.config(hf, tensors.keys())
    model = lazy_module(config)
    plan = _plan(model, arch, tensors)
    problems = _problems(plan, arch, tensors)
    if problems:
        raise ValueError(f"{origin} ({hf.get('model_type')}) does not map onto tfport's modules: "
                         + " | ".join(problems))
    canonical, _ = _aliases(model)
    tied: dict[str, list[tuple[str, Rule, tuple[str, ...]]]] = {}
    for alias, target, rule, names in plan.tied:
        tied.setdefault(target, []).append((alias, rule, names))
    duplicates = [(copy, original) for copy, original in arch.duplicates.items()
                  if copy in tensors and original in plan.used]

    def reader(target: str, rule: Rule, names: tuple[str, ...]):
        shape = tuple(canonical[target].shape)

        def read() -> torch.Tensor:
            with torch.no_grad():
                values = _build(target, rule, names, shape, config, tensors)
                for alias, alias_rule, alias_names in tied.get(target, ()):
                    if not torch.equal(_build(alias, alias_rule, alias_names, shape, config, tensors), values):
                        raise ValueError(
                            f"{origin}: {', '.join(map(tensors.where, alias_names))} differs from the "
                            f"tensor it is tied to ({target}); tfport holds them as one tensor "
                            "(tie_word_embeddings, or the one token table an encoder-decoder's "
                            "stacks share), so they must be equal")
                for copy, original in duplicates:
                    if original in names and not torch.equal(tensors.get(copy), tensors.get(original)):
                        raise ValueError(f"{origin}: {tensors.where(copy)} differs from "
                                         f"{tensors.where(original)}, of which it is a tied copy")
            return values

        return read

    attach(model, {target: reader(target, rule, names) for target, rule, names in plan.loads})
    log.info("imported %s %s (%d tensors%s)", hf.get("model_type"), origin, len(plan.loads),
             ", lazily" if lazy else "")
    return model.eval() if lazy else materialize_all(model).eval()
