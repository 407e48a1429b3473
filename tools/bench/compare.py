"""``tfport bench --source ... --quantize int4,int8 [--genai DIR] [--llama-cpp GGUF]``: tfport's
float and quantised exports against other CPU engines on the same weights, batch 1.

One run exports the source once per (target, format), opens every side, then alternates timed
runs between all of them (a prefill of ``--contexts`` tokens and ``--new-tokens`` greedy steps,
``--repeats`` rounds; medians). Each
tfport row has its own roofline: the bytes its weight products read per token, taken from the
export's graph (quantised codes, scales and zero points; gathered embedding rows excluded), over
the bandwidth measured in the same run. Ratios are within the run: each row against the fastest
peer and against tfport's float32 export of the same target. ``--thread-sweep`` adds the ort
float32 export opened with the default thread policy and with explicit settings, to show which
is fastest here and now; ``--peer-threads 1,2`` times each peer at each thread count (a peer's
best setting need not be the bench's: onnxruntime-genai int4 ran 8.9 ms/token at 1 thread and
18.6 at 2 on the 2-core VM in one run).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tfport.export.quant import FORMATS, get_format
from .measurement import BenchSettings, RunTiming, load_average, machine_info, measure, time_tfport
from .roofline import measure_bandwidth

log = logging.getLogger(__name__)

FLOAT = "fp32"  # the unquantised export's format, whatever its dtype
ASYMMETRIC = "-asym"  # a format with zero points: int4-asym (without it, int4 and int8 are symmetric)
# --quantize: every format, and those with a layout with zero points too
QUANTIZED_FORMATS = (*FORMATS, *(f"{name}{ASYMMETRIC}" for name, fmt in FORMATS.items() if fmt.layout_options))
PRODUCT_OPS = {"MatMul", "MatMulNBits", "DequantizeLinear", "Gemm", "MatMulInteger"}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass
class Side:
    """One thing timed: a tfport export (``kind`` "tfport") or a peer engine."""

    label: str
    kind: str  # "tfport" | "onnxruntime-genai" | "llama.cpp"
    run: Callable[[np.ndarray, int], RunTiming] = field(repr=False)
    weight_bytes: int | None = None
    format: str = FLOAT
    target: str | None = None


@dataclass
class CompareRow:
    label: str
    kind: str
    format: str
    prefill_ms: float
    step_ms: float
    tokens_per_s: float
    weight_mb_per_token: float | None
    roofline_tokens_per_s: float | None
    roofline_pct: float | None
    vs_fastest_peer: float | None = None
    vs_tfport_fp32: float | None = None  # over the unquantised export of the same target and dtype
    target: str | None = None
    step_ms_repeats: list[float] = field(default_factory=list)
    first_tokens: list[int] = field(default_factory=list)


def product_weight_bytes(graph_path: Path) -> int:
    """Bytes of the initializers that weight products read (through Transposes, Reshapes and
    Casts: a bfloat16 weight is cast to float32 on its way): what one decode step at batch 1 reads
    from memory, embedding gathers aside."""
    model = onnx.load(str(graph_path), load_external_data=False)
    sizes = {}
    for tensor in model.graph.initializer:
        bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}.get(tensor.data_type)
        itemsize = bits / 8 if bits else onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        sizes[tensor.name] = int(np.prod(tensor.dims, dtype=np.int64) * itemsize)
    producers = {out: node for node in model.graph.node for out in node.output}
    counted: set[str] = set()
    for node in model.graph.node:
        if node.op_type not in PRODUCT_OPS:
            continue
        for name in node.input[1:] if node.op_type != "DequantizeLinear" else node.input:
            source = producers.get(name)
            while source is not None and source.op_type in ("Transpose", "Reshape", "Cast"):
                name = source.input[0]
                source = producers.get(name)
            if name in sizes:
                counted.add(name)
    return sum(sizes[name] for name in counted)


def _tfport_sides(source, source_name: str, settings: BenchSettings, formats: tuple[str, ...],
                  root: Path, thread_sweep: bool) -> list[Side]:
    from tfport.runtime import load_model
    from tfport.runtime.model import Model
    from tfport.runtime.session import SessionSettings

    from tfport.export.exporter import export_model, source_options
    from tfport.export.options import ExportOptions

    sides = []
    for target in settings.targets:
        for fmt in (FLOAT, *formats):
            label = f"tfport {target} {fmt}"
            if settings.dtype != "float32":  # the float row is named by its dtype, the others carry it
                label = f"tfport {target} {SHORT[settings.dtype]}" if fmt == FLOAT else f"{label} {SHORT[settings.dtype]}"
            out = root / f"{target}-{fmt}"
            quantize = symmetric = None
            if fmt != FLOAT:
                quantize = fmt.removesuffix(ASYMMETRIC)
                layout = get_format(quantize)
                symmetric = not fmt.endswith(ASYMMETRIC) if layout.layout_options else None
                quantize = layout.for_source(source_name, settings.dtype) or quantize  # keep: the file's blocks
            options = ExportOptions(dtype=settings.dtype, target=target, quantize=quantize,
                                    symmetric=symmetric, validate=False)
            if fmt == "int4":  # as `tfport export --quantize int4` takes the source: a 4-bit file keeps its blocks
                kept = source_options(options.replace(symmetric=None), source_name)
                if kept.quantize != quantize:
                    options, label = kept, f"{label} (the file's blocks, {kept.activations or 'int8'} activations)"
            export_model(source.model, out, options)
            model = load_model(out, settings.provider, intra_op_threads=settings.threads)
            sides.append(Side(label, "tfport", lambda p, n, m=model: time_tfport(m, p, n),
                              product_weight_bytes(out / "decoder.onnx"), fmt, target))
    if thread_sweep:
        target = settings.targets[-1]
        out = root / f"{target}-{FLOAT}"
        for threads, label in ((0, "default policy"), (1, "1 thread"), (2, "2 threads")):
            model = Model.load(out, settings=SessionSettings(settings.provider, intra_op_threads=threads))
            sides.append(Side(f"tfport {target} {FLOAT} [{label}]", "tfport",
                              lambda p, n, m=model: time_tfport(m, p, n),
                              product_weight_bytes(out / "decoder.onnx"), FLOAT, target))
    return sides


def peer_sides(settings: BenchSettings, genai: tuple[str, ...], gguf: tuple[str, ...],
               peer_threads: tuple[int, ...] = ()) -> tuple[list[Side], list[str]]:
    """The peers' sides (onnxruntime-genai directories, GGUF files under llama.cpp; each at each
    of ``peer_threads``, default the bench's threads) and why any were skipped (not installed);
    the comparison and the Pareto view (``pareto``) time the same sides."""
    from .peers import GenaiPeer, LlamaCppPeer, available

    sides, skipped = [], []
    # (engine, its module, the paths given, how a path names the weights, the peer's class)
    engines = (("onnxruntime-genai", "onnxruntime_genai", genai, lambda p: Path(p).name, GenaiPeer),
               ("llama.cpp", "llama_cpp", gguf, lambda p: Path(p).stem, LlamaCppPeer))
    for engine, module, paths, weights, peer in engines:
        for path in paths:
            reason = available(module)
            if reason:
                skipped.append(f"{engine} {path}: {reason}")
                continue
            for threads in peer_threads or (settings.threads,):
                sides.append(Side(f"{engine} {weights(path)} [{threads} threads]", engine,
                                  peer(path, threads), format=weights(path)))
    return sides, skipped


def run_compare(settings: BenchSettings, source_name: str, formats: tuple[str, ...],
                genai: tuple[str, ...] = (), gguf: tuple[str, ...] = (),
                thread_sweep: bool = False, peer_threads: tuple[int, ...] = ()) -> dict[str, Any]:
    """Export, open and time every side (alternating), then rows with rooflines and ratios."""
    from tfport.export.source import load_source

    formats = tuple(formats)
    unknown = [f for f in formats if f not in QUANTIZED_FORMATS]
    if unknown or len(set(formats)) != len(formats):
        raise ValueError(f"--quantize {','.join(formats)}: expected distinct formats among "
                         f"{', '.join(QUANTIZED_FORMATS)} (the unquantised export is always timed)")
    if len(settings.contexts) != 1:
        raise ValueError(f"--contexts {settings.contexts}: the engine comparison times one prompt length")
    if (genai or gguf) and settings.provider != "cpu":
        raise ValueError(f"provider={settings.provider!r}: the peers (--genai, --llama-cpp) run on the "
                         "CPU; compare them with provider='cpu', or time tfport alone on this provider")
    for fmt in formats:  # refused now rather than after the other sides are exported (keep: a GGUF file)
        get_format(fmt.removesuffix(ASYMMETRIC)).check_source(source_name, settings.dtype)
    load_before = load_average()
    source = load_source(source_name, settings.seed)
    context, steps = settings.contexts[0], settings.new_tokens
    with tempfile.TemporaryDirectory(prefix="tfport-compare-") as tmp:
        sides = _tfport_sides(source, source_name, settings, formats, Path(tmp), thread_sweep)
        peers, skipped = peer_sides(settings, genai, gguf, peer_threads)
        sides += peers
        vocab = source.model.config.vocab_size
        prompts = np.random.default_rng(settings.seed).integers(min(100, vocab // 2), vocab, size=(1, context))
        timings = measure([(lambda n, s=s: s.run(prompts, n)) for s in sides], steps, settings.repeats,
                          settings.settle_ms)
        meta = [dataclasses.replace(s, run=None) for s in sides]
        del sides, peers  # close the sessions before the bandwidth is measured
    bandwidth = measure_bandwidth(settings)
    rows = [_row(side, runs, bandwidth.gbps) for side, runs in zip(meta, timings)]
    fill_ratios(rows)
    return {"format": "tfport-bench-compare/1", "source": source_name,
            "settings": dataclasses.asdict(settings), "formats": list(formats),
            "machine": {**machine_info(settings), "load_average_before": load_before,
                        "load_average_after": load_average()},
            "bandwidth": bandwidth.to_dict(), "rows": [dataclasses.asdict(r) for r in rows],
            "skipped": skipped}


def _row(side: Side, runs: list[RunTiming], gbps: float) -> CompareRow:
    step = statistics.median(statistics.median(r.step_ms) for r in runs)
    roofline = None if side.weight_bytes is None else gbps * 1e9 / side.weight_bytes
    return CompareRow(side.label, side.kind, side.format, statistics.median(r.prefill_ms for r in runs),
                      step, 1e3 / step, None if side.weight_bytes is None else side.weight_bytes / 1e6,
                      roofline, None if roofline is None else 100 * (1e3 / step) / roofline,
                      step_ms_repeats=[statistics.median(r.step_ms) for r in runs],
                      first_tokens=[int(t) for t in runs[-1].tokens[0, :8]], target=side.target)


def fill_ratios(rows: list[CompareRow]) -> None:
    """Each row's tokens/s over the fastest peer's and over tfport's float32 row of its target."""
    peers = [r for r in rows if r.kind != "tfport"]
    fastest = max(peers, key=lambda r: r.tokens_per_s) if peers else None
    floats = {r.target: r for r in rows if r.kind == "tfport" and r.format == FLOAT and "[" not in r.label}
    for row in rows:
        if fastest is not None:
            row.vs_fastest_peer = row.tokens_per_s / fastest.tokens_per_s
        if row.kind == "tfport":
            base = floats.get(row.target)
            if base is not None:
                row.vs_tfport_fp32 = row.tokens_per_s / base.tokens_per_s


def format_compare(result: dict[str, Any]) -> str:
    """The comparison as a table (ratios within this run)."""
    s = result["settings"]
    bw = result["bandwidth"]
    lines = [f"source {result['source']}: batch 1, prompt {s['contexts'][0]} tokens, "
             f"{s['new_tokens']} greedy steps x {s['repeats']} repeats, {s['threads']} threads, "
             f"load average {result['machine']['load_average_before']} -> "
             f"{result['machine']['load_average_after']}",
             f"bandwidth {bw['used_gbps']:.1f} GB/s ({bw['source']})", ""]
    header = ("side", "prefill ms", "step ms", "tokens/s", "MB/token", "% roofline",
              "vs fastest peer", f"vs tfport {SHORT[s.get('dtype', 'float32')]}")
    table = [header]
    for r in result["rows"]:
        table.append((r["label"], f"{r['prefill_ms']:.1f}", f"{r['step_ms']:.2f}",
                      f"{r['tokens_per_s']:.1f}",
                      "-" if r["weight_mb_per_token"] is None else f"{r['weight_mb_per_token']:.1f}",
                      "-" if r["roofline_pct"] is None else f"{r['roofline_pct']:.0f}%",
                      "-" if r["vs_fastest_peer"] is None else f"{r['vs_fastest_peer']:.2f}x",
                      "-" if r["vs_tfport_fp32"] is None else f"{r['vs_tfport_fp32']:.2f}x"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
    lines += [f"skipped: {reason}" for reason in result["skipped"]]
    return "\n".join(lines)
