"""Calibrated weight quantisation: GPTQ (Frantar et al. 2022) in the export's block layout.

Round-to-nearest picks each weight's code on its own; GPTQ picks them to keep a product's
*output* close on real activations. For a weight W [N, K] whose inputs x [K] are seen on a
calibration text, the output error of a change dW is ``sum over tokens |dW x|^2 = tr(dW H dW^T)``
with ``H = E[x x^T]`` [K, K]. GPTQ quantises W one column at a time; after rounding a column it
spreads that column's error over the columns not yet quantised, the update that minimises the
output error given H (the optimal brain surgeon step; with the inverse of H's Cholesky factor
every step is one row of a triangular matrix). With the columns taken in order k = 0 .. K-1:

    err = (W[:, k] - Q[:, k]) / U[k, k]        W[:, k+1:] -= err U[k, k+1:]      (H^-1 = U^T U)

Here the columns go in order of decreasing H diagonal ("act-order", GPTQ's option for small
models) with "static groups": each block of ``block_size`` columns gets its scale (and zero
point) up front from the original weights, by the clipping search of round-to-nearest
(``quantize._best_rtn``) with each column's error weighted by H's diagonal, and every column is
rounded with its own block's scale wherever the order reaches it. So the result is an ordinary
``BlockQuantized``: the same codes, scales and zero points in the same layout, which every
export target lowers unchanged; only which codes (and scales) are chosen differs. On SmolLM2
act-order lowered perplexity over in-order GPTQ with scales chosen as each block is reached
(24.68 vs 24.97 asymmetric, 25.46 vs 26.74 symmetric, PyTorch with the fake-quantised weights, on
the first 320 tokens of the perplexity text).

The value rows of attention get their own H per key/value head (``collect_hessians``): a
value's error reaches the output through the attention-weighted average of the inputs, and an
error along an input that every query attends to is never averaged away. On SmolLM2 this alone
took asymmetric in-order GPTQ from 27.36 to 24.97 (float32 23.51).

H comes from forward hooks on every ``nn.Linear`` of the reference module while it reads a
calibration text (``Calibration``: a built-in text of mixed prose, dialogue, instructions and
code, ``export/data/calibration.txt``, or a file), cut into sequences for decoders or into
sentences for encoders. It is *not* the perplexity text of ``tfport parity --accuracy``.

``PrecomputedQuantization`` quantises every weight matrix of the module up front (GPTQ where a
Hessian was seen, round-to-nearest elsewhere, the LM head and token table at ``head_bits``) and
finds them again by their rows' exact values, like ``gguf_keep.KeptQuantization``: a drop-in for
``QuantScheme`` in the exporter and in ``quantize.fake_quantize``, so the exact parity check
compares the graph with the module holding the same dequantised weights.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from tfport.dtypes import NUMPY_DTYPES

from .quantize import (SEARCH_FACTORS, BlockQuantized, QuantScheme, RowIndex, _best_rtn, concat_rows,
                       nearest_codes, token_table_paths)

log = logging.getLogger(__name__)

BUILTIN = "builtin"
BUILTIN_TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
DEFAULT_TOKENS = 4096  # calibration tokens (the built-in text has about 3,200 in SmolLM2's tokenizer)
MIN_TOKENS = 16
SEQUENCE_LENGTH = 512  # a decoder reads the text in sequences of this many tokens (or max_positions)
BATCH_TOKENS = 2048  # tokens per forward pass while collecting activations
LAZY_COLUMNS = 128  # columns whose errors are applied to the rest at once
DAMP = 0.1  # H += DAMP * mean(diag H) * I: well conditioned, and less fitted to a short text


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


RowHessians = list[tuple[int, int, torch.Tensor]]  # (first row, end row, H [K, K]) covering a weight


@torch.no_grad()
def collect_hessians(model: nn.Module, sequences: list[np.ndarray], progress: bool = False) -> dict[str, RowHessians]:
    """Weight name (module path + ".weight") -> the Hessians its rows are quantised with, for
    every ``nn.Linear`` of ``model`` on ``sequences`` (token id arrays [S]), from forward hooks.

    Rows of a product see H = mean of x x^T over its inputs x [K]. The value rows of attention
    (``qkv``, cross-attention ``kv``) see, per key/value head, the mean of z z^T over the query
    positions of the heads reading it, z = sum_t p_t x_t: the inputs averaged with that head's
    attention probabilities (the ``probs`` tap), because a value's error reaches the output only
    through that average -- an error along an input every query attends to (the first token,
    which most heads attend to) is never averaged away, and the plain H weighs it as one token.
    """
    from tfport.models.attention import Attention

    inputs: dict[str, _Mean] = {}
    values: dict[str, tuple[int, int, _Mean]] = {}  # weight -> (first value row, head dim, [Hkv, K, K])
    seen: dict[str, torch.Tensor] = {}  # attention path -> its value rows' input [B, T, K]
    handles = []

    def on_input(name: str):
        def hook(module, args, output):
            inputs.setdefault(name, _Mean()).add(args[0].reshape(-1, args[0].shape[-1]).float())
        return hook

    def on_value_input(path: str):
        def hook(module, args, output):
            seen[path] = args[0].float()
        return hook

    def on_probs(path: str, attn: Attention, name: str):
        def hook(module, args, probs):  # probs [B, H, S, T]
            x = seen[path]  # [B, T, K]
            b, h, s, t = probs.shape
            groups = probs.float().reshape(b, attn.kv_heads, h // attn.kv_heads, s, t)
            z = torch.einsum("bjgst,btk->jbgsk", groups, x)  # [Hkv, B, G, S, K]
            values[name][2].add(z.reshape(attn.kv_heads, -1, x.shape[-1]))
        return hook

    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(on_input(f"{path}.weight")))
        if isinstance(module, Attention):
            source = module.kv if module.cross else module.qkv  # the product with the value rows
            name = f"{path}.{'kv' if module.cross else 'qkv'}.weight"
            kv_dim = module.kv_heads * module.head_dim
            first = kv_dim if module.cross else module.n_heads * module.head_dim + kv_dim
            values[name] = (first, module.head_dim, _Mean())
            handles.append(source.register_forward_hook(on_value_input(path)))
            handles.append(module.probs.register_forward_hook(on_probs(path, module, name)))
    try:
        model.eval()
        for ids in tqdm(batches(sequences), desc="calibrate: activations", unit="batch", disable=not progress):
            _run(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    hessians = {}
    for name, moments in inputs.items():
        n = model.get_parameter(name).shape[0]
        hessians[name] = [(0, n, moments.mean())]
        if name in values and values[name][2].count:
            first, head_dim, value_moments = values[name]
            hessians[name] = [(0, first, moments.mean())] + [
                (first + j * head_dim, first + (j + 1) * head_dim, h) for j, h in enumerate(value_moments.mean())]
    return hessians


# ------------------------------------------------------------------------------------ GPTQ
def gptq_rows(rows: np.ndarray, hessian: torch.Tensor, bits: int, block_size: int, symmetric: bool,
              scale_dtype: str = "float32", damp: float = DAMP) -> BlockQuantized:
    """GPTQ quantisation of ``rows`` [N, K] (an ``nn.Linear`` weight) for inputs with second
    moment ``hessian`` [K, K] (see the module doc), in blocks of ``block_size`` along K with
    scales rounded to ``scale_dtype`` before the codes are chosen, as ``quantize_rows`` does.

    Scales (and zero points) are chosen first, per block, from the original weights (the clipping
    search of ``quantize_rows`` with each column's error weighted by H's diagonal); then the
    columns are quantised in order of decreasing H diagonal ("act-order": the inputs with the
    largest energy first, while the most columns are left to absorb their error), each with its
    own block's scale, so the blocks stay those of the layout.
    """
    rows = np.asarray(rows, dtype=np.float32)
    n, k = rows.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian: expected shape {(k, k)} for rows {rows.shape}, got {tuple(hessian.shape)}")
    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0  # inputs that are always 0: nothing to compensate into them
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    scales, zero_points = _block_scales(rows, torch.diagonal(h).float().numpy(), bits, block_size, symmetric,
                                        NUMPY_DTYPES[scale_dtype])
    order = torch.argsort(torch.diagonal(h), descending=True)  # [K]: column quantised at step i
    h = h[order][:, order]
    inverse_factor = torch.linalg.solve_triangular(torch.linalg.cholesky(h), torch.eye(k, dtype=h.dtype), upper=False)
    u = torch.linalg.cholesky(inverse_factor.T @ inverse_factor, upper=True).float()  # H^-1 = U^T U
    order = order.numpy()
    w = torch.from_numpy(rows[:, order])  # [N, K] in quantisation order, updated as columns are done
    step = scales.astype(np.float32)  # [N, Kb]
    zero = (np.full(scales.shape, 1 << (bits - 1), np.float32) if zero_points is None
            else zero_points.astype(np.float32))
    codes = np.zeros((n, k), np.uint8)
    for c0 in range(0, k, LAZY_COLUMNS):  # errors reach later columns in lazy batches (GPTQ's trick)
        c1 = min(k, c0 + LAZY_COLUMNS)
        errors = torch.zeros((n, c1 - c0))
        for i in range(c0, c1):
            column, block = order[i], order[i] // block_size
            code = nearest_codes(w[:, i].numpy(), step[:, block],
                                 None if zero_points is None else zero_points[:, block], bits)
            codes[:, column] = code
            err = (w[:, i] - torch.from_numpy((code - zero[:, block]) * step[:, block])) / u[i, i]  # [N]
            w[:, i + 1:c1] -= err[:, None] * u[i, i + 1:c1][None, :]
            errors[:, i - c0] = err
        w[:, c1:] -= errors @ u[c0:c1, c1:]
    return BlockQuantized(codes, scales, zero_points, bits, block_size)


def _block_scales(rows: np.ndarray, importance: np.ndarray, bits: int, block_size: int, symmetric: bool,
                  dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales [N, Kb] (``dtype``) and zero points (uint8 [N, Kb] or None) of ``rows`` [N, K] by the
    importance-weighted clipping search (``quantize._best_rtn``); a short last block is padded
    with zeros of no importance."""
    n, k = rows.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = rows
    weights = np.zeros(n_blocks * block_size, np.float32)
    weights[:k] = importance
    factors = SEARCH_FACTORS if bits == 4 else (1.0,)
    scales, zero_points, _ = _best_rtn(padded.reshape(n, n_blocks, block_size), bits, symmetric, dtype, factors,
                                       weights.reshape(n_blocks, block_size))
    return scales, zero_points


# ------------------------------------------------------------------ the precomputed scheme
HEAD_BITS = (4, 8)


class PrecomputedQuantization:
    """Every weight matrix of a module quantised up front and found again by its rows (see the
    module doc): a drop-in for ``QuantScheme`` in the exporter and ``fake_quantize`` (``quantize``,
    ``embeddings``, ``name``, ``to_dict``). Built by ``calibrate``."""

    def __init__(self, scheme: QuantScheme, index: RowIndex, scale_dtype: str, record: dict):
        self.scheme, self.index, self.scale_dtype, self.record = scheme, index, scale_dtype, record
        self.embeddings = scheme.embeddings
        self.name = scheme.name
        self.found = self.requantized = 0

    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> BlockQuantized:
        """The precomputed blocks of ``rows`` [N, K]; rows the module did not have (none, in an
        export of that module) are quantised with round-to-nearest."""
        if scale_dtype != self.scale_dtype:
            raise ValueError(f"scale_dtype={scale_dtype!r}: this quantisation was calibrated for "
                             f"{self.scale_dtype!r} scales (calibrate with the export dtype)")
        found = self.index.find(rows)
        if found is None:
            self.requantized += 1
            log.info("calibrated: a [%d, %d] weight is not one of the module's; round-to-nearest", *rows.shape)
            return self.scheme.quantize(rows, scale_dtype)
        self.found += 1
        return found

    def to_dict(self) -> dict:
        return {**self.scheme.to_dict(), **self.record}


def calibrate(model: nn.Module, scheme: QuantScheme, sequences: list[np.ndarray] | None,
              scale_dtype: str = "float32", head_bits: int | None = None, damp: float = DAMP,
              progress: bool = False, record: dict | None = None) -> PrecomputedQuantization:
    """Quantise every weight matrix of ``model`` with ``scheme``'s block layout: GPTQ on each
    ``nn.Linear`` with the Hessian of its inputs on ``sequences`` (token id arrays [S]; None:
    round-to-nearest everywhere), the token tables (when ``scheme.embeddings``) with
    round-to-nearest, and the LM head and token table with ``head_bits`` (None: the scheme's bits).
    ``record`` is added to the manifest's quantisation entry."""
    if head_bits is not None and head_bits not in HEAD_BITS:
        raise ValueError(f"head_bits={head_bits!r}: expected None or one of {list(HEAD_BITS)}")
    hessians = collect_hessians(model, sequences, progress) if sequences else {}
    tables = [model.get_parameter(path) for path in token_table_paths(model)]
    head = getattr(model, "lm_head", None)
    heads = {id(p) for p in tables} | ({id(head.weight)} if isinstance(head, nn.Linear) else set())
    skipped = set() if scheme.embeddings else {id(p) for p in tables}  # the float table and a tied head
    if head_bits is not None and not heads - skipped:
        raise ValueError(f"head_bits={head_bits!r}: this model has no LM head or token table quantised "
                         "apart from the other products (a tied head whose table stays float)")
    matrices = {f"{path}.weight": m.weight for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    matrices.update({path: p for path, p in zip(token_table_paths(model), tables) if scheme.embeddings})
    index, done = RowIndex(), set(skipped)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # GPTQ is many small steps: one thread is faster, and the same on any machine
    try:
        for name, weight in tqdm(matrices.items(), desc="calibrate: quantise", unit="matrix", disable=not progress):
            if id(weight) in done:  # a tied table is quantised once, with the head's Hessian
                continue
            done.add(id(weight))
            bits = head_bits if head_bits is not None and id(weight) in heads else scheme.bits
            rows = weight.detach().float().cpu().numpy()
            if name not in hessians:  # a token table (untied), or no calibration
                quantized = QuantScheme(bits, scheme.block_size, scheme.symmetric).quantize(rows, scale_dtype)
            else:
                quantized = concat_rows([gptq_rows(rows[start:end], hessian, bits, scheme.block_size,
                                                   scheme.symmetric, scale_dtype, damp)
                                         for start, end, hessian in hessians[name]])
            index.add(rows, quantized)
    finally:
        torch.set_num_threads(threads)
    record = dict(record or {})
    if head_bits is not None:
        record["head_bits"] = head_bits
    return PrecomputedQuantization(scheme, index, scale_dtype, record)


def fingerprint(index: RowIndex) -> str:
    """sha256 of every precomputed matrix's codes, scales and zero points, in order: what a
    recomputation (``tfport parity``) must reproduce."""
    digest = hashlib.sha256()
    for matrix in index.matrices:
        for part in (matrix.codes, matrix.scales, matrix.zero_points):
            if part is not None:
                digest.update(np.ascontiguousarray(part).tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- export options
def calibrated_scheme(model: nn.Module, scheme, calibration: str | Calibration | None, tokenizer,
                      scale_dtype: str = "float32", head_bits: int | None = None,
                      progress: bool | None = None) -> PrecomputedQuantization:
    """``export_model``'s ``calibration`` and ``head_bits``: ``scheme`` (a ``QuantScheme``)
    calibrated with GPTQ on ``calibration`` ("builtin", a text file's path or a ``Calibration``;
    None: round-to-nearest) read with ``tokenizer`` (a tokenizer.json path), the LM head and
    token table at ``head_bits``."""
    if scheme is None or not isinstance(scheme, QuantScheme):
        option = f"calibration={calibration!r}" if calibration is not None else f"head_bits={head_bits!r}"
        got = "no quantisation" if scheme is None else f"quantize={scheme.name!r}"
        raise ValueError(f"{option}: applies to quantize='int4' or 'int8' (round-to-nearest blocks it "
                         f"re-chooses), got {got}")
    if isinstance(calibration, (str, Path)):
        calibration = Calibration(str(calibration))
    elif calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration={calibration!r}: expected None, {BUILTIN!r}, a text file's path "
                        "or a Calibration")
    if progress is None:
        progress = sum(p.numel() for p in model.parameters()) > 2**24
    sequences, record = None, {}
    if calibration is not None:
        if tokenizer is None:
            raise ValueError(f"calibration={calibration.text!r}: reading the text needs the model's "
                             "tokenizer (tokenizer=PATH to tokenizer.json; tfport export --tokenizer)")
        from tokenizers import Tokenizer

        sequences = token_sequences(calibration.read(), Tokenizer.from_file(str(tokenizer)), model.config,
                                    calibration.tokens)
        log.info("calibrate: GPTQ on %d tokens of %s (%d sequences)", sum(map(len, sequences)),
                 calibration.text, len(sequences))
        record = {"method": "gptq", "damp": DAMP, "calibration": calibration.to_dict()}
    quantization = calibrate(model, scheme, sequences, scale_dtype, head_bits, progress=progress, record=record)
    quantization.record["sha256"] = fingerprint(quantization.index)
    return quantization


def recorded_scheme(quantization: dict, model: nn.Module, tokenizer, scale_dtype: str,
                    text: str | None = None) -> PrecomputedQuantization:
    """The calibrated quantisation a manifest records (``quantization``), recomputed from
    ``model`` with ``tokenizer`` and the same text (the built-in one, or ``text``: the path of
    the file the export was calibrated with); raises ``ValueError`` if the text or the result
    differs from the export's."""
    scheme = QuantScheme(quantization["bits"], quantization["block_size"], quantization["symmetric"],
                         quantization.get("embeddings", True))
    calibration = None
    if "calibration" in quantization:
        recorded = quantization["calibration"]
        if recorded["text"] != BUILTIN and text is None:
            raise ValueError(f"the export was calibrated on {recorded['text']!r}: pass that file "
                             "(tfport parity --calibration FILE) to recompute its quantised weights")
        calibration = Calibration(BUILTIN if text is None else str(text), recorded["tokens"])
        if calibration.to_dict()["sha256"] != recorded["sha256"]:
            raise ValueError(f"calibration text {calibration.text!r}: its sha256 differs from the one "
                             f"the export was calibrated with ({recorded['text']!r})")
    result = calibrated_scheme(model, scheme, calibration, tokenizer, scale_dtype, quantization.get("head_bits"))
    if result.record["sha256"] != quantization.get("sha256"):
        raise ValueError("recomputing the calibrated quantisation gave other codes than the export's "
                         "(sha256 differs): a different reference module, tokenizer or PyTorch build")
    return result
