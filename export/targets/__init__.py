"""Export targets by name: the one place a target name is looked up.

Each target is one module with one object (see ``base.PortableTarget`` for what a target owns);
adding a target is a new module plus an entry here (or ``register_target``), and the parity and
export tests, which parametrise over ``TARGETS``, pick it up.
"""

from __future__ import annotations

from ..lowering import Target  # the interface every target implements (subclass PortableTarget)
from .base import PortableTarget
from .onnx23 import Onnx23Target
from .ort import OrtTarget

TARGETS: dict[str, Target] = {}
DEFAULT_TARGET = "portable"  # what every model exports to, on any ONNX runtime


def register_target(target: Target) -> Target:
    """Make ``target`` exportable by its name; returns it."""
    TARGETS[target.name] = target
    return target


def get_target(target: str | Target) -> Target:
    """The target called ``target`` (a target object passes through)."""
    if isinstance(target, PortableTarget):
        return target
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"target={target!r}: expected one of {list(TARGETS)}")
    return TARGETS[target]


for _target in (PortableTarget(), OrtTarget(), Onnx23Target()):
    register_target(_target)

__all__ = ["Target", "TARGETS", "DEFAULT_TARGET", "get_target", "register_target", "PortableTarget", "OrtTarget",
           "Onnx23Target"]
