"""``tfport bench-scale``: export, load and decode models of the sizes people deploy, against
llama.cpp on the same file.

For each shape (``scale_models.SHAPES``: Llama-3.2-1B / 3B, Llama-3.1-8B, Qwen2.5-7B) and format
(a GGUF file in Q4_0 or Q8_0, exported with ``--quantize keep``; a bf16 safetensors directory,
exported with ``--quantize int4 --calibration none``; ``--quantize int4``: tfport's default int4;
``--activations int8,float``: an export on each), it writes the random-weight model once
(kept in ``--work``), then measures, each step in a child process of its own so that one step's
memory does not count in the next:

* export: wall time and peak resident memory (``tfport export``, validated unless
  ``--no-validate``);
* tfport: load time and resident memory after loading, time to first token of a
  ``--prompt``-token prompt, decode tokens/s at batch 1 and at ``--rows`` rows, peak resident
  memory while running (the high-water mark is reset once the model is loaded; the loading's
  own peak is ``load_peak`` in the JSON) against the weights' bytes plus the KV cache (the
  largest a run holds, in float32: one row of ``--prompt`` + ``--new-tokens`` tokens or
  ``--rows`` rows of 32 + ``--new-tokens``; and the keys and values the runtime's prefix cache
  holds of earlier prompts);
* llama.cpp (llama-cpp-python, where installed; GGUF files only): the same figures on the same
  file, with ``--threads`` threads as tfport.

Decode rates are ``new tokens / (time of 1 + n tokens - time of 1 token)`` over ``--repeats``
runs, median; prompts are random token ids, each time to first token a prompt never seen before
(tfport's runtime keeps prompt prefixes across calls); nothing stops early. Rows print as a table;
``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tfport.contract import ACTIVATIONS
from tfport.files import write_text_atomic

from tfport.export.quant import INT4, KEEP
from .scale_models import FORMATS, SHAPES, Shape, write_gguf, write_safetensors

log = logging.getLogger(__name__)
GiB = 2**30
GGUF_KINDS = ("Q4_0", "Q8_0", "F16")

# Run in a child: an export, reporting its wall time and peak resident memory as the last line.
EXPORT_CHILD = """
import json, sys, time
from tfport.cli import main
from tfport.heap import peak_resident
start = time.perf_counter()
code = main(["export", *sys.argv[1:]])
print(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                  "peak": peak_resident()}))
"""

# Run in a child: load an export (tfport) or a GGUF file (llama.cpp), then time a prompt's first
# token and decoding at 1 and at ROWS rows. argv: engine, path, prompt, new tokens, rows, repeats,
# threads, vocabulary.
RUN_CHILD = """
import json, statistics, sys, time
import numpy as np
from tfport.heap import peak_resident
engine, path = sys.argv[1], sys.argv[2]
prompt, new, rows, repeats, threads, vocab = map(int, sys.argv[3:9])

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

rng = np.random.default_rng(0)

def fresh(length):  # a prompt no cache has seen (tfport keeps prompt prefixes across calls)
    return [int(i) for i in rng.integers(1000, vocab - 1000, length)]

short = [fresh(32) for _ in range(rows)]
start = time.perf_counter()
if engine == "tfport":
    from tfport.runtime import load_model
    model = load_model(path, intra_op_threads=threads)

    def run(prompts, n):
        model.generate(prompts, max_new_tokens=n, stop_token_ids=())
else:
    from llama_cpp import Llama
    model = Llama(path, n_ctx=prompt + new + 64, n_threads=threads, n_batch=512, n_seq_max=1,
                  logits_all=False, verbose=False)

    def run(prompts, n):
        if len(prompts) > 1:
            raise NotImplementedError
        model.reset()
        produced = 0
        for _ in model.generate(prompts[0], temp=0.0, reset=True):
            produced += 1
            if produced == n:
                break
load = time.perf_counter() - start
loaded, load_peak = resident(), peak_resident()
try:  # the peak while running from here on: Linux resets VmHWM to the current resident size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    running_peak = True
except OSError:  # the peak stays the whole process's, loading included
    running_peak = False

def timed(prompts, n):
    start = time.perf_counter()
    run(prompts, n)
    return time.perf_counter() - start

def rate(prompts, n):
    # tokens/s of decoding: (n - 1) tokens per row over the time past the first token
    firsts, wholes = [], []
    for _ in range(repeats):
        firsts.append(timed(prompts, 1))
        wholes.append(timed(prompts, n))
    return len(prompts) * (n - 1) / max(statistics.median(wholes) - statistics.median(firsts), 1e-9)

timed([fresh(prompt)], 1)  # warm-up
ttft = statistics.median(timed([fresh(prompt)], 1) for _ in range(repeats))
one = rate([short[0]], new)
try:
    many = rate(short, new) if rows > 1 else None
except NotImplementedError:
    many = None
# keys and values tfport's prefix cache holds of earlier prompts (full by then: it fills first)
cached = getattr(getattr(model, "prefix_cache", None), "bytes", 0)
print(json.dumps({"load": load, "loaded": loaded, "ttft": ttft, "decode1": one, "decoden": many,
                  "peak": peak_resident(), "cached": cached, "load_peak": load_peak,
                  "peak_since_load": running_peak}))
"""


@dataclass
class ScaleRow:
    """One shape x format: the export's and each engine's figures (None: not measured)."""

    shape: str
    format: str
    parameters: int
    source_bytes: int
    export_seconds: float | None = None
    export_peak: int | None = None
    weight_bytes: int | None = None  # the export's files
    kv_bytes: int | None = None  # the largest KV cache of a run (float32)
    engines: dict[str, dict] = field(default_factory=dict)  # "tfport" / "llama.cpp" -> run figures
    notes: list[str] = field(default_factory=list)


def _child(script: str, args: list[str], timeout: float) -> dict:
    """Run ``script`` in a fresh interpreter; its last stdout line is JSON. stderr (progress
    bars, logs) goes to ours."""
    done = subprocess.run([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"child exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def source_path(shape: Shape, fmt: str, work: Path) -> Path:
    """Where the random-weight model of ``shape`` in ``fmt`` lives (written if missing)."""
    if fmt == "bf16-safetensors":
        path = work / f"{shape.name}-bf16"
        if not path.is_dir():
            log.info("writing %s", path)
            write_safetensors(shape, path)
        return path
    path = work / f"{shape.name}.{fmt}.gguf"
    if not path.is_file():
        log.info("writing %s", path)
        write_gguf(shape, fmt, path)
    return path


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


QUANTIZE = {  # --quantize: how each format is exported
    "source": "a GGUF file's own blocks (keep), safetensors as int4 round-to-nearest (--calibration none)",
    "int4": "tfport's default --quantize int4 (a 4-bit GGUF file's own blocks on mixed activations; GPTQ on "
            "the built-in text for the others, which ship a tokenizer: Q8_0)",
}


def export_args(source: Path, fmt: str, out: Path, validate: bool, quantize: str = "source",
                activations: str | None = None) -> list[str]:
    """``tfport export`` arguments of the benchmark's export of ``fmt`` (``quantize``: ``QUANTIZE``;
    ``activations``: one of ``tfport.contract.ACTIVATIONS``, None for the export's default)."""
    if quantize == "int4":
        how = ["--quantize", INT4.name]
    elif fmt in GGUF_KINDS:
        how = ["--quantize", KEEP.name]
    else:
        how = ["--quantize", INT4.name, "--calibration", "none"]
    if activations is not None:
        how += ["--activations", activations]
    return [str(source), "--out", str(out), "--target", "ort", *how, *([] if validate else ["--no-validate"])]


def measure(shape: Shape, fmt: str, settings: argparse.Namespace, activations: str | None = None,
            peers: bool = True) -> ScaleRow:
    """The figures of one shape and format with quantised products on ``activations`` (see the
    module doc); llama.cpp's too when ``peers``."""
    work = Path(settings.work)
    source = source_path(shape, fmt, work)
    quantize = getattr(settings, "quantize", "source")
    label = fmt if quantize == "source" else f"{fmt} -> {quantize}"
    name = f"{source.name}.export" if quantize == "source" else f"{source.name}.{quantize}.export"
    if activations is not None:
        label, name = f"{label}, {activations} activations", f"{name}.{activations}"
    row = ScaleRow(shape.name, label, shape.parameters(), _size(source))
    out = work / name
    if out.exists() and settings.reuse_exports:
        row.notes.append("export reused (--reuse-exports): no export figures")
    else:
        if out.exists():
            import shutil

            shutil.rmtree(out)
        figures = _child(EXPORT_CHILD, export_args(source, fmt, out, settings.validate, quantize, activations),
                         settings.timeout)
        if figures["code"] != 0:
            row.notes.append(f"export failed (exit {figures['code']})")
            return row
        row.export_seconds, row.export_peak = figures["seconds"], figures["peak"]
    row.weight_bytes = _size(out)
    # the largest cache a run holds: the long prompt's row, or the rows of 32-token prompts
    tokens = max(settings.prompt + settings.new_tokens, settings.rows * (32 + settings.new_tokens))
    row.kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4 * tokens
    args = [str(settings.prompt), str(settings.new_tokens), str(settings.rows), str(settings.repeats),
            str(settings.threads), str(shape.vocab)]
    row.engines["tfport"] = _child(RUN_CHILD, ["tfport", str(out), *args], settings.timeout)
    if fmt in GGUF_KINDS and settings.llama_cpp and peers:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            row.notes.append("llama.cpp: llama-cpp-python is not installed")
        else:
            row.engines["llama.cpp"] = _child(RUN_CHILD, ["llama.cpp", str(source), *args], settings.timeout)
    return row


def format_rows(rows: list[ScaleRow], settings: argparse.Namespace) -> str:
    """The table: one line per shape, format and engine."""
    def gib(value):
        return "-" if value is None else f"{value / GiB:.2f}"

    def num(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    head = (f"| model | format | engine | export min | export peak GiB | load s | loaded GiB | "
            f"TTFT {settings.prompt} s | decode tok/s B1 | B{settings.rows} | peak GiB (x weights+KV) |")
    lines = [head, "|" + " --- |" * 11]
    for row in rows:
        for engine, run in row.engines.items() or {"-": {}}.items():
            base = (row.weight_bytes if engine == "tfport" else row.source_bytes) or 0
            resident = run.get("peak")
            kv = (row.kv_bytes or 0) + run.get("cached", 0)  # the prefix cache holds keys and values too
            ratio = f" ({resident / (base + kv):.2f}x)" if resident and base else ""
            export = engine == "tfport"
            lines.append(
                f"| {row.shape} | {row.format} | {engine} | "
                f"{num(row.export_seconds / 60 if export and row.export_seconds else None)} | "
                f"{gib(row.export_peak if export else None)} | {num(run.get('load'))} | "
                f"{gib(run.get('loaded'))} | {num(run.get('ttft'), 2)} | {num(run.get('decode1'))} | "
                f"{num(run.get('decoden'))} | {gib(resident)}{ratio} |")
        for note in row.notes:
            lines.append(f"|  |  | note: {note} |" + " |" * 8)
    return "\n".join(lines)


def run_scale(settings: argparse.Namespace) -> list[ScaleRow]:
    rows = []
    for name in settings.shapes:
        for fmt in settings.formats:
            for i, activations in enumerate(getattr(settings, "activations", (None,))):
                rows.append(measure(SHAPES[name], fmt, settings, activations, peers=i == 0))
                print(format_rows(rows[-1:], settings), flush=True)
    return rows


def _choices(allowed, what: str):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [v for v in values if v not in allowed]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} from {list(allowed)}")
        return values
    return parse


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("bench-scale", help="export, load and decode 1B-8B shaped models against llama.cpp",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=_choices(SHAPES, "shape names"), default=("llama-3.2-1b",),
                   help=f"comma-separated, from {', '.join(SHAPES)} (default llama-3.2-1b)")
    p.add_argument("--formats", type=_choices(FORMATS, "formats"), default=("Q4_0",),
                   help=f"comma-separated, from {', '.join(FORMATS)} (default Q4_0)")
    p.add_argument("--quantize", choices=list(QUANTIZE), default="source",
                   help="; ".join(f"{k}: {v}" for k, v in QUANTIZE.items()) + " (default source)")
    p.add_argument("--activations", type=_choices(ACTIVATIONS, "activations"), default=(None,),
                   help=f"comma-separated, from {', '.join(ACTIVATIONS)}: an export each, with its quantised "
                        f"products on those activations (tfport export --activations; default: the "
                        f"export's own)")
    p.add_argument("--work", default="out/scale", help="where models and exports are kept (default out/scale)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for time to first token (default 512)")
    p.add_argument("--new-tokens", type=int, default=33, help="tokens generated per decode run (default 33)")
    p.add_argument("--rows", type=int, default=8, help="rows of the batched decode (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure, median (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per engine (default: CPUs)")
    p.add_argument("--no-validate", dest="validate", action="store_false", help="export without validation")
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip llama.cpp")
    p.add_argument("--reuse-exports", action="store_true", help="keep exports already in --work (no export figures)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per step (default 3600)")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.set_defaults(func=run_scale_cli)


def run_scale_cli(args: argparse.Namespace) -> int:
    for name in ("prompt", "new_tokens", "rows", "repeats", "threads"):
        if getattr(args, name) < 1 or (name == "new_tokens" and args.new_tokens < 2):
            raise SystemExit(f"tfport bench-scale: --{name.replace('_', '-')}={getattr(args, name)}: "
                             f"expected at least {2 if name == 'new_tokens' else 1}")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    rows = run_scale(args)
    print(f"\n{started}, {cpu_name()}, {args.threads} threads; every figure a median of {args.repeats} runs")
    print(format_rows(rows, args))
    if args.json:
        payload = {"format": "tfport.bench-scale/1", "date": started, "cpu": cpu_name(), "threads": args.threads,
                   "rows": [asdict(row) for row in rows]}
        print(f"wrote {write_text_atomic(args.json, json.dumps(payload, indent=1) + chr(10))}")
    return 0


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo) and whether it has AVX-512."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                "unknown CPU")
    return f"{name} ({'AVX-512' if ' avx512f' in info else 'AVX2'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tfport")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench-scale", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
