"""Calibration activations: where they come from (``Calibration``: the built-in text of mixed
prose, dialogue, instructions and code, ``export/data/calibration.txt``, or a file; *not* the
perplexity text of ``tfport parity --accuracy``), the token sequences the reference module reads
(decoders: sequences of up to ``SEQUENCE_LENGTH`` tokens; encoders: sentences), and the Hessians
H = E[x x^T] [K, K] of every ``nn.Linear``'s inputs, collected by forward hooks
(``collect_hessians``), that GPTQ (``gptq``) quantises each weight with.

The value rows of attention get their own H per key/value head: a value's error reaches the
output through the attention-weighted average of the inputs, and an error along an input that
every query attends to is never averaged away. On SmolLM2 this alone took asymmetric in-order
GPTQ from 27.36 to 24.97 (float32 23.51).
"""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

BUILTIN = "builtin"
AUTO = "auto"  # the default: GPTQ on the built-in text for int4 when the tokenizer is known
NONE = "none"  # round-to-nearest
BUILTIN_TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
DEFAULT_TOKENS = 4096  # calibration tokens (the built-in text has about 3,200 in SmolLM2's tokenizer)
MIN_TOKENS = 16
SEQUENCE_LENGTH = 512  # a decoder reads the text in sequences of this many tokens (or max_positions)
BATCH_TOKENS = 2048  # tokens per forward pass while collecting activations


@dataclass(frozen=True)
class Calibration:
    """Where the calibration activations come from: ``text`` is "builtin" (the text shipped in
    ``export/data/calibration.txt``) or the path of a UTF-8 text file; ``tokens`` is how many of
    its tokens the reference module reads (at most; fewer if the text is shorter)."""

    text: str = BUILTIN
    tokens: int = DEFAULT_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < MIN_TOKENS:
            raise ValueError(f"calibration_tokens={self.tokens!r}: expected an integer >= {MIN_TOKENS}")
        if self.text != BUILTIN and not Path(self.text).is_file():
            raise ValueError(f"calibration={self.text!r}: expected {BUILTIN!r} or the path of a text file")

    def read(self) -> str:
        path = BUILTIN_TEXT if self.text == BUILTIN else Path(self.text)
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"calibration={self.text!r}: the text is empty")
        return text

    def to_dict(self) -> dict:
        """What the manifest records: the text's name and sha256, so that ``tfport parity`` can
        check it is calibrating with the same text."""
        name = BUILTIN if self.text == BUILTIN else Path(self.text).name
        return {"text": name, "sha256": hashlib.sha256(self.read().encode()).hexdigest(), "tokens": self.tokens}


# ------------------------------------------------------------------------- calibration inputs
def sentences(text: str) -> list[str]:
    """The text's sentences (split after . ! ? and at blank lines; lines of code kept whole)."""
    pieces = []
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(line.strip() for line in paragraph.splitlines() if line.strip())
        pieces.extend(s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s)
    return pieces


def token_sequences(text: str, tokenizer, config, tokens: int) -> list[np.ndarray]:
    """int64 token sequences [S] with ``tokens`` ids in all (fewer if the text runs out): a
    decoder (and an encoder-decoder) reads the text in sequences of ``SEQUENCE_LENGTH`` (or
    ``max_positions``) tokens, an encoder one sentence at a time (with its special tokens).
    ``tokenizer`` is a ``tokenizers.Tokenizer``."""
    length = min(SEQUENCE_LENGTH, config.max_positions)
    tokenizer.no_padding()  # every sequence is its own length (batches() groups equal lengths)
    tokenizer.no_truncation()
    if config.family == "encoder":
        encoded = [np.array(e.ids[:length], np.int64) for e in tokenizer.encode_batch(sentences(text))]
    else:
        ids = np.array(tokenizer.encode(text).ids, np.int64)
        encoded = [ids[i:i + length] for i in range(0, len(ids), length)]
    encoded = [e for e in encoded if len(e) >= 2]
    chosen, total = [], 0
    for sequence in encoded:
        if total >= tokens:
            break
        sequence = sequence[:tokens - total] if config.family != "encoder" else sequence
        chosen.append(sequence)
        total += len(sequence)
    if total < tokens:
        log.info("calibration: all %d tokens of the text (up to %d asked for)", total, tokens)
    return chosen


def batches(sequences: list[np.ndarray], max_tokens: int = BATCH_TOKENS) -> list[np.ndarray]:
    """The sequences grouped by length into batches [B, S] of at most ``max_tokens`` tokens (one
    sequence if longer), so that no batch needs padding."""
    by_length: dict[int, list[np.ndarray]] = {}
    for ids in sequences:
        by_length.setdefault(len(ids), []).append(ids)
    out = []
    for length, group in by_length.items():
        step = max(1, max_tokens // length)
        out.extend(np.stack(group[i:i + step]) for i in range(0, len(group), step))
    return out


def _run(model: nn.Module, ids: np.ndarray) -> None:
    """One forward pass of the reference module over ``ids`` [B, S] (or [S]), no padding."""
    x = torch.from_numpy(ids).reshape(-1, ids.shape[-1])  # [B, S]
    mask = torch.ones_like(x)
    if model.config.family == "encoder-decoder":  # the decoder reads the same text, shifted right
        start = torch.full_like(x[:, :1], model.config.decoder_start_token_id)
        model(x, torch.cat([start, x[:, :-1]], dim=1), mask, mask)
    else:
        model(x, mask)


class _Mean:
    """A running mean of Gram matrices x^T x (float64), over ``count`` vectors x."""

    def __init__(self):
        self.total, self.count = None, 0

    def add(self, x: torch.Tensor) -> None:
        """x [n, K] (or [G, n, K]: G Gram matrices at once)."""
        gram = (x.transpose(-1, -2) @ x).double()  # [K, K] or [G, K, K]
        self.total = gram if self.total is None else self.total + gram
        self.count += x.shape[-2]

    def mean(self) -> torch.Tensor:
        return self.total / self.count


class _Stop(Exception):
    """Raised by the last hook of a calibration pass: the rest of the forward pass is not needed."""


class _Passes:
    """Where a calibration pass may stop. A first pass over two tokens (the probe) lists the hooks
    in the order they run, doing none of their work; when each ran once, every later pass stops
    after the last one (``ran`` raises ``_Stop``), skipping what no hook reads: the LM head's
    product, and the layers after a group's (``calibrate.hessian_groups``). The hooks a module
    runs do not depend on the sequence length, so the probe's last is every pass's last."""

    def __init__(self):
        self.order: list[str] | None = []  # the probe's hooks, in order; None once it ended
        self.last: str | None = None

    def probing(self, hook: str) -> bool:
        """True (and the hook is noted) while the probe runs: the hook does nothing then."""
        if self.order is not None:
            self.order.append(hook)
        return self.order is not None

    def end_probe(self) -> None:
        order, self.order = self.order, None
        if order and len(set(order)) == len(order):  # a hook that runs twice in a pass: never stop
            self.last = order[-1]

    def ran(self, hook: str) -> None:
        if hook == self.last:
            raise _Stop


RowHessians = list[tuple[int, int, torch.Tensor]]  # (first row, end row, H [K, K]) covering a weight


def hessian_bytes(model: nn.Module, name: str) -> int:
    """Bytes of the float64 Hessians ``collect_hessians`` keeps for the weight ``name`` [N, K]:
    one [K, K], plus one per key/value head for the value rows of an attention's qkv / kv."""
    from tfport.models.attention import Attention

    k = model.get_parameter(name).shape[1]
    path, _, product = name.removesuffix(".weight").rpartition(".")
    owner = model.get_submodule(path) if path else model
    extra = owner.kv_heads if isinstance(owner, Attention) and product == ("kv" if owner.cross else "qkv") else 0
    return (1 + extra) * k * k * 8


@torch.no_grad()
def collect_hessians(model: nn.Module, sequences: list[np.ndarray], progress: bool = False,
                     names: set[str] | None = None) -> dict[str, RowHessians]:
    """Weight name (module path + ".weight") -> the Hessians its rows are quantised with, for
    every ``nn.Linear`` of ``model`` (or those of ``names``: one pass per group of layers keeps
    the memory bounded on large models) on ``sequences`` (token id arrays [S]), from forward hooks.

    Rows of a product see H = mean of x x^T over its inputs x [K]. The value rows of attention
    (``qkv``, cross-attention ``kv``) see, per key/value head, the mean of z z^T over the query
    positions of the heads reading it, z = sum_t p_t x_t: the inputs averaged with that head's
    attention probabilities (the ``probs`` tap), because a value's error reaches the output only
    through that average -- an error along an input every query attends to (the first token,
    which most heads attend to) is never averaged away, and the plain H weighs it as one token.
    Products that read the same input tensor (a gated FFN's gate and up, a mixture's router and
    experts) share one running mean and one H.
    """
    from tfport.models.attention import Attention

    inputs: dict[str, _Mean] = {}
    values: dict[str, tuple[int, int, _Mean]] = {}  # weight -> (first value row, head dim, [Hkv, K, K])
    seen: dict[str, torch.Tensor] = {}  # attention path -> its value rows' input [B, T, K]
    read: dict[int, tuple[weakref.ref, int, _Mean]] = {}  # id(input) -> (input, its version, its mean)
    passes = _Passes()
    handles = []

    def on_input(name: str):
        def hook(module, args):
            if passes.probing(name):
                return
            x = args[0]
            known = read.get(id(x))
            if known and known[0]() is x and known[1] == x._version and inputs.get(name, known[2]) is known[2]:
                inputs[name] = known[2]  # the input another product read (gate and up, experts): one mean
            else:
                inputs.setdefault(name, _Mean()).add(x.reshape(-1, x.shape[-1]).float())
                read[id(x)] = (weakref.ref(x), x._version, inputs[name])
            passes.ran(name)
        return hook

    def on_value_input(path: str):
        def hook(module, args):
            seen[path] = args[0].float()
        return hook

    def on_probs(path: str, attn: Attention, name: str):
        def hook(module, args, probs):  # probs [B, H, S, T]
            if passes.probing(f"{name} values"):
                return
            x = seen[path]  # [B, T, K]
            b, h, s, t = probs.shape
            groups = probs.float().reshape(b, attn.kv_heads, h // attn.kv_heads, s, t)
            z = torch.einsum("bjgst,btk->jbgsk", groups, x)  # [Hkv, B, G, S, K]
            values[name][2].add(z.reshape(attn.kv_heads, -1, x.shape[-1]))
            passes.ran(f"{name} values")
        return hook

    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and (names is None or f"{path}.weight" in names):
            handles.append(module.register_forward_pre_hook(on_input(f"{path}.weight")))
        if isinstance(module, Attention):
            source = module.kv if module.cross else module.qkv  # the product with the value rows
            name = f"{path}.{'kv' if module.cross else 'qkv'}.weight"
            if names is not None and name not in names:
                continue
            kv_dim = module.kv_heads * module.head_dim
            first = kv_dim if module.cross else module.n_heads * module.head_dim + kv_dim
            values[name] = (first, module.head_dim, _Mean())
            handles.append(source.register_forward_pre_hook(on_value_input(path)))
            handles.append(module.probs.register_forward_hook(on_probs(path, module, name)))
    try:
        model.eval()
        _run(model, sequences[0][:2])  # the probe: which hook runs last
        passes.end_probe()
        for ids in tqdm(batches(sequences), desc="calibrate: activations", unit="batch", disable=not progress):
            try:
                _run(model, ids)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    hessians, means = {}, {}
    for name, moments in inputs.items():
        n = model.get_parameter(name).shape[0]
        mean = means.setdefault(id(moments), moments.mean())  # one tensor for products of one input
        hessians[name] = [(0, n, mean)]
        if name in values and values[name][2].count:
            first, head_dim, value_moments = values[name]
            hessians[name] = [(0, first, mean)] + [
                (first + j * head_dim, first + (j + 1) * head_dim, h) for j, h in enumerate(value_moments.mean())]
    return hessians
