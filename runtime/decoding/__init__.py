"""Decoding: the step engine every entry point shares (``engine``) and one module per cache layout
(``concat``, ``inplace``), each registered in ``DECODINGS`` as a ``LayoutDecoding`` (``layout``
says what one holds). An export's manifest records its decoder graph's cache layout
(``tfport.contract.LAYOUTS``); the runtime looks its decoding up once, when a model or a request
starts: ``decoding_for(manifest.layout)``.
"""

from __future__ import annotations

from . import concat, inplace  # noqa: F401  (each registers its layout's decoding)
from .concat import ConcatCache, ConcatRows
from .engine import LogitsProcessor, SequenceState, choose
from .inplace import InplaceBuffer, InplaceRows
from .layout import DECODINGS, Advance, DecodeStrategy, LayoutDecoding, Relayout, decoding_for, register_decoding
from .prefix import PrefixCache
from .rows import Row, RowBatch
from .speculative import Speculation, SpeculationStats

__all__ = ["Advance", "DecodeStrategy", "Relayout", "LayoutDecoding", "DECODINGS", "decoding_for",
           "register_decoding", "SequenceState", "LogitsProcessor", "choose", "Row", "RowBatch",
           "ConcatCache", "ConcatRows", "InplaceBuffer", "InplaceRows", "Speculation", "SpeculationStats", "PrefixCache"]
