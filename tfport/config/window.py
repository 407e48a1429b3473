"""Sliding-window attention: which layers attend through a window, and how wide it is.
``ModelConfig.window`` holds one; ``ModelConfig`` checks the layer indices against its depth."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import Part, is_int


@dataclass(frozen=True)
class WindowConfig(Part):
    """A sliding window of ``size`` W over the layers listed in ``layers`` (all layers when null);
    no window when ``size`` is null.

    In a decoder (causal) those layers see keys at most W - 1 positions before the query (the
    query itself included: W keys), as Mistral, Gemma 2/3 and Phi-3 do. In an encoder
    (bidirectional) they see keys at most W // 2 positions away on either side (2 (W // 2) + 1
    keys), so that ModernBERT's ``local_attention`` is W. Positions count real tokens, as RoPE's do.
    """

    PATH = "window"

    size: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check = self.checks()
        check.positive_ints("size", optional=True)
        if self.layers is not None:
            if not isinstance(self.layers, tuple) or not all(is_int(i) for i in self.layers):
                check.fail("layers", "a tuple of layer indices or null (= every layer)")
            if len(set(self.layers)) != len(self.layers):
                check.fail("layers", "distinct layer indices")
            if self.size is None:
                check.fail("layers", "null unless window.size is set")

    def covers(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the window."""
        return self.size is not None and (self.layers is None or layer in self.layers)
