"""Calibrated weight quantisation: every weight matrix of a module quantised up front, GPTQ
(``gptq``) on the Hessians of its inputs over a calibration text (``hessians``) where one was
seen, round-to-nearest elsewhere, the LM head and token table at ``head_bits`` in blocks of
``head_block``.

``PrecomputedQuantization`` holds the result and finds each matrix again by its rows' exact values
(``row_index.RowIndex``), like ``quant.keep.KeptQuantization``: a blockwise scheme
(``quant.blockwise.Blockwise``) for the exporter and for ``quant.fake_quantize``, so the exact
parity check compares the graph with the module holding the same dequantised weights.
``calibrated_scheme`` is ``export_model``'s ``calibration`` / ``head_bits``; ``recorded_scheme``
recomputes what a manifest records.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from tfport.config.checks import is_int
from tfport.models.lazy import read_weight

from .blocks import BlockQuantized, compact, concat_rows
from .gptq import DAMP, gptq_bytes, gptq_rows
from .hessians import (AUTO, BUILTIN, NONE, Calibration, RowHessians, collect_hessians, hessian_bytes,
                       token_sequences)
from .quant import (BLOCK_SIZES, HEAD_BITS, PROMOTED_BITS, Blockwise, QuantScheme, layout_formats,
                    token_table_paths)
from .row_index import RowIndex, row_keys

log = logging.getLogger(__name__)

HESSIAN_BUDGET = 2 * 2**30  # bytes of Hessians held at once (float64; see hessian_groups)
WORK_BUDGET = 2 * 2**30  # bytes of GPTQ working memory (gptq.gptq_bytes) in flight across threads


class PrecomputedQuantization(Blockwise):
    """Every weight matrix of a module quantised up front and found again by its rows (see the
    module doc): the blockwise scheme of ``scheme``'s format with these codes. Built by ``calibrate``."""

    def __init__(self, scheme: QuantScheme, index: RowIndex, scale_dtype: str, record: dict,
                 names: list[str]):
        self.scheme, self.index, self.scale_dtype, self.record = scheme, index, scale_dtype, record
        self.names = names  # the parameter name of each of index.matrices
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

    def bytes_per_value(self) -> float:
        return self.scheme.bytes_per_value()

    def to_dict(self) -> dict:
        return {**self.scheme.to_dict(), **self.record}


def layer_of(matrix: str) -> str | None:
    """The decoder or encoder layer a weight matrix belongs to ("decoder.layers.3" for
    "decoder.layers.3.attn.q.weight"), None outside the layers (the head, the tables): what a
    promoted name (``calibrate``, ``budget.promote_layers``) stands for."""
    parts = matrix.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[:i + 2])
    return None


def head_block(block_size: int, width: int, fixed: int | None = None) -> int:
    """The block size of an LM head or token table of ``width`` values per row (E): ``fixed``
    when given, else the largest of ``BLOCK_SIZES`` up to ``block_size`` that divides ``width``
    (whole blocks: a tied table is stored once, gathered and projected from the same codes, and
    no block is padded; SmolLM2's E = 576 in blocks of 128 gets 64, 1.5 points less perplexity
    increase), ``block_size`` when none does."""
    if fixed is not None:
        return fixed
    return max((b for b in BLOCK_SIZES if b <= block_size and width % b == 0), default=block_size)


def check_head_block_size(head_block_size: int | None) -> None:
    """``ValueError`` naming ``head_block_size`` unless None or one of ``BLOCK_SIZES``."""
    if head_block_size is not None and (isinstance(head_block_size, bool) or head_block_size not in BLOCK_SIZES):
        raise ValueError(f"head_block_size={head_block_size!r}: expected None or one of {list(BLOCK_SIZES)}")


def head_weights(model: nn.Module, scheme: QuantScheme) -> list[nn.Parameter]:
    """The LM head and token tables ``scheme`` quantises (a tied pair once; without
    ``scheme.embeddings`` the tables stay float, and so does a head tied to one)."""
    tables = [model.get_parameter(path) for path in token_table_paths(model)]
    head = getattr(model, "lm_head", None)
    found = (tables if scheme.embeddings else []) + ([head.weight] if isinstance(head, nn.Linear) else [])
    floats = set() if scheme.embeddings else {id(p) for p in tables}
    return list({id(p): p for p in found if id(p) not in floats}.values())


def own_head_block(model: nn.Module, scheme) -> bool:
    """Whether ``head_block`` gives ``scheme``'s LM head or a token table other blocks than its
    own (then ``calibrate`` quantises it, round-to-nearest without a calibration text)."""
    return scheme is not None and scheme.rechoosable and any(
        head_block(scheme.block_size, p.shape[1]) != scheme.block_size for p in head_weights(model, scheme))


def in_order(layers) -> tuple[str, ...]:
    """Layer names in model order ("decoder.layers.2" before "decoder.layers.12")."""
    return tuple(sorted(layers, key=lambda name: [int(p) if p.isdigit() else p for p in name.split(".")]))


def calibrate(model: nn.Module, scheme: QuantScheme, sequences: list[np.ndarray] | Mapping[str, np.ndarray] | None,
              scale_dtype: str = "float32", head_bits: int | None = None, progress: bool = False,
              record: dict | None = None, threads: int | None = None,
              promoted: tuple[str, ...] = (), head_block_size: int | None = None) -> PrecomputedQuantization:
    """Quantise every weight matrix of ``model`` with ``scheme``'s block layout: GPTQ on each
    ``nn.Linear`` with the Hessian of its inputs on ``sequences`` (token id arrays [S], or the
    Hessians already collected over them, ``collect_hessians``' result, when several layouts are
    calibrated on the same text; None: round-to-nearest everywhere), the token tables (when ``scheme.embeddings``) with
    round-to-nearest, and the LM head and token table with ``head_bits`` (None: the scheme's bits)
    in blocks of ``head_block(scheme.block_size, E, head_block_size)``; GPTQ damps each Hessian by
    ``DAMP`` (which the manifest records). ``record`` is added to the manifest's quantisation
    entry.
    ``threads`` matrices are quantised at once (None: ``resolve_threads``), each on one thread,
    with at most ``WORK_BUDGET`` bytes of working memory in flight: the codes do not depend on it.
    ``promoted`` names decoder or encoder layers (``layer_of``) whose matrices are quantised
    at ``PROMOTED_BITS`` with the scheme's blocks, recorded as ``promoted``."""
    if head_bits is not None and head_bits not in HEAD_BITS:
        raise ValueError(f"head_bits={head_bits!r}: expected None or one of {list(HEAD_BITS)}")
    check_head_block_size(head_block_size)
    hessians = dict(sequences) if isinstance(sequences, Mapping) else None
    threads = resolve_threads(threads)
    tables = [model.get_parameter(path) for path in token_table_paths(model)]
    heads = {id(p) for p in head_weights(model, scheme)}
    skipped = set() if scheme.embeddings else {id(p) for p in tables}  # the float table and a tied head
    if head_bits is not None and not heads:
        raise ValueError(f"head_bits={head_bits!r}: this model has no LM head or token table quantised "
                         "apart from the other products (a tied head whose table stays float)")
    matrices = {f"{path}.weight": m.weight for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    matrices.update({path: p for path, p in zip(token_table_paths(model), tables) if scheme.embeddings})
    layers = {layer_of(key) for key in matrices}
    for name in promoted:
        if name not in layers:
            raise ValueError(f"promoted={name!r}: not a layer of this model with weight matrices")
    raised = {key for key in matrices if layer_of(key) in promoted}
    index, done, added, head_blocks = RowIndex(), set(skipped), [], set()
    groups = [list(matrices)] if hessians is not None or not sequences else hessian_groups(model, list(matrices))
    torch_threads = torch.get_num_threads()  # set to 1 by the workers, and global: restored after
    try:
        with (tqdm(total=len(matrices), desc="calibrate: quantise", unit="matrix", disable=not progress) as bar,
              ThreadPoolExecutor(threads, thread_name_prefix="gptq", initializer=torch.set_num_threads,
                                 initargs=(1,)) as pool):  # one thread per matrix: the same codes anywhere
            for group in groups:
                group_hessians = hessians
                if group_hessians is None:  # one forward pass per group of layers: bounded memory
                    group_hessians = collect_hessians(model, sequences, progress, set(group)) if sequences else {}
                jobs, names = [], []  # (weight, its Hessians or None, bits, block); their names
                for name in group:
                    weight = matrices[name]
                    if id(weight) in done:  # a tied table is quantised once, with the head's Hessian
                        bar.update()
                        continue
                    done.add(id(weight))
                    bits = head_bits if head_bits is not None and id(weight) in heads else scheme.bits
                    bits = PROMOTED_BITS if name in raised else bits
                    block = scheme.block_size
                    if id(weight) in heads:
                        block = head_block(block, weight.shape[1], head_block_size)
                        head_blocks.add(block)
                    jobs.append((weight, group_hessians.get(name), bits, block))
                    names.append(name)
                work = [(_work_bytes(weight.shape, row_hessians), _quantise_matrix,
                         (weight, row_hessians, QuantScheme(bits, block, scheme.symmetric), scale_dtype, DAMP))
                        for weight, row_hessians, bits, block in jobs]
                del group_hessians, jobs  # each job holds its own Hessians: freed when it is done
                quantized = _run_bounded(pool, work, bar.update)  # each job reads its weight as it starts
                for (keys, matrix), name in zip(quantized, names):
                    index.add_keys(keys, compact(matrix))  # held until the graphs are written
                    added.append(name)
    finally:
        torch.set_num_threads(torch_threads)
    record = dict(record or {})
    if head_bits is not None:
        record["head_bits"] = head_bits
    if promoted:
        record["promoted"] = list(promoted)
    if head_blocks:  # one width (E) in the models tfport builds, so one block size
        record["head_block_size"] = max(head_blocks)
    return PrecomputedQuantization(scheme, index, scale_dtype, record, added)


def resolve_threads(threads: int | None) -> int:
    """``calibration_threads``: how many matrices ``calibrate`` quantises at once (None: the cores
    this process may run on); ``ValueError`` unless a positive integer or None."""
    if threads is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not is_int(threads) or threads < 1:
        raise ValueError(f"calibration_threads={threads!r}: expected a positive integer, or None for the "
                         "machine's cores")
    return threads


def _quantise_matrix(weight: torch.Tensor, hessians: RowHessians | None, scheme: QuantScheme, scale_dtype: str,
                     damp: float) -> tuple[list[bytes], BlockQuantized]:
    """``weight`` [N, K] (read now: only the running jobs' weights are in memory) with GPTQ on
    each row range's Hessian, or round-to-nearest without one (a token table, or no calibration);
    returns its rows' keys (``row_keys``, how the exporter finds it again) and its blocks. Runs
    on a worker thread with one torch thread."""
    rows = read_weight(weight)
    keys = row_keys(rows)
    if hessians is None:
        return keys, scheme.quantize(rows, scale_dtype)
    return keys, concat_rows([gptq_rows(rows[start:end], hessian, scheme.bits, scheme.block_size,
                                        scheme.symmetric, scale_dtype, damp) for start, end, hessian in hessians])


def _work_bytes(shape: tuple[int, ...], hessians: RowHessians | None) -> int:
    """The working memory ``_quantise_matrix`` needs for a weight of ``shape`` [N, K] (the
    largest of its GPTQ calls, which count the rows read)."""
    if hessians is None:
        return 4 * shape[0] * shape[1]
    return max(gptq_bytes(end - start, hessian.shape[0]) for start, end, hessian in hessians)


def _run_bounded(pool: ThreadPoolExecutor, jobs: list[tuple[int, Callable, tuple]], on_done: Callable[[], object],
                 budget: int | None = None) -> list:
    """``fn(*args)`` of every job ``(bytes, fn, args)`` on ``pool``, starting each once the bytes
    of the jobs running with it fit in ``budget`` (default ``WORK_BUDGET``; one job always runs);
    ``on_done()`` after each job. The results, in the jobs' order; a job's error is raised as soon
    as it is seen, and the jobs not started yet are cancelled. ``jobs`` is emptied as they start,
    so a finished job's arguments (a matrix's Hessians) are freed while later ones run."""
    budget = WORK_BUDGET if budget is None else budget
    running: dict[Future, int] = {}
    futures = []
    jobs.reverse()  # popped from the end: in order

    def finish(return_when: str) -> None:
        finished, _ = wait(running, return_when=return_when)
        for future in finished:
            del running[future]
            future.result()  # raises the job's error
            on_done()

    try:
        while jobs:
            size, fn, args = jobs.pop()
            while running and sum(running.values()) + size > budget:
                finish(FIRST_COMPLETED)
            future = pool.submit(fn, *args)
            del args
            running[future] = size
            futures.append(future)
        finish(ALL_COMPLETED)
    finally:
        for future in running:
            future.cancel()
    return [future.result() for future in futures]


def hessian_groups(model: nn.Module, names: list[str], budget: int | None = None) -> list[list[str]]:
    """``names`` (weights, in module order) cut into consecutive groups whose Hessians
    (``hessian_bytes``) fit in ``budget`` bytes (default ``HESSIAN_BUDGET``; a matrix larger
    than the budget is a group of its own): one calibration pass each. The codes do not depend
    on the grouping (every pass runs the unquantised module), only the time: SmolLM2's Hessians
    (about 1.1 GB) are one group, a 1.2B LLaMA's (11 GB in float64) six."""
    budget = HESSIAN_BUDGET if budget is None else budget
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        linear = isinstance(model.get_submodule(name.removesuffix(".weight")), nn.Linear)
        size = hessian_bytes(model, name) if linear else 0  # a token table has no Hessian
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


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
def resolve_calibration(scheme, calibration: str | Calibration | None, tokenizer) -> str | Calibration | None:
    """What ``ExportOptions.calibration`` asks for ``scheme``: "auto" (the default) is GPTQ on the
    built-in text for int4 when ``tokenizer`` is known (round-to-nearest loses 4-5x more
    perplexity: docs/quantisation.md), round-to-nearest for int8 (within 0.1% already), and
    round-to-nearest with a warning for int4 without a tokenizer; "none" or None is
    round-to-nearest; anything else is returned for ``calibrated_scheme``."""
    if calibration is None or calibration == NONE:
        return None
    if calibration != AUTO:
        return calibration
    if scheme is None or not scheme.rechoosable or scheme.bits != 4:
        return None
    if tokenizer is None:
        log.warning("quantize='int4' without a tokenizer: round-to-nearest codes (about 40%% more "
                    "perplexity than float32 on SmolLM2, against 8%% with GPTQ); pass the tokenizer "
                    "(tfport export --tokenizer) to calibrate, or calibration='none' to choose this")
        return None
    return BUILTIN


def calibrated_scheme(model: nn.Module, scheme, calibration: str | Calibration | None, tokenizer,
                      scale_dtype: str = "float32", head_bits: int | None = None,
                      progress: bool | None = None, threads: int | None = None,
                      promoted: tuple[str, ...] = (), head_block_size: int | None = None
                      ) -> PrecomputedQuantization:
    """``export_model``'s ``calibration``, ``head_bits`` and ``head_block_size``: ``scheme`` (a ``QuantScheme``)
    calibrated with GPTQ on ``calibration`` ("builtin", a text file's path or a ``Calibration``;
    None: round-to-nearest) read with ``tokenizer`` (a tokenizer.json path), the LM head and
    token table at ``head_bits``, the ``promoted`` modules' matrices at ``PROMOTED_BITS``,
    ``threads`` matrices at once (``calibrate``)."""
    if scheme is None or not scheme.rechoosable:
        option = next(f"{name}={value!r}" for name, value in (("calibration", calibration), ("head_bits", head_bits),
                                                              ("head_block_size", head_block_size))
                      if value is not None)
        got = "no quantisation" if scheme is None else f"quantize={scheme.name!r}"
        raise ValueError(f"{option}: applies to quantize={layout_formats()} (round-to-nearest blocks it "
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
    quantization = calibrate(model, scheme, sequences, scale_dtype, head_bits, progress=progress, record=record,
                             threads=threads, promoted=tuple(promoted), head_block_size=head_block_size)
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
    result = calibrated_scheme(model, scheme, calibration, tokenizer, scale_dtype, quantization.get("head_bits"),
                               promoted=tuple(quantization.get("promoted", ())),
                               # exports from before head_block kept the head in the others' blocks
                               head_block_size=quantization.get("head_block_size", scheme.block_size))
    if result.record["sha256"] != quantization.get("sha256"):
        raise ValueError("recomputing the calibrated quantisation gave other codes than the export's "
                         "(sha256 differs): a different reference module, tokenizer or PyTorch build")
    return result
