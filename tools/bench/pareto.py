"""``tfport bench --pareto --source SRC [--layouts ...] [--genai DIR] [--llama-cpp GGUF]``:
decode speed against accuracy for tfport's quantised layouts and the peers' quantisations of the
same weights, in one run.

Every point is one engine x layout: decode tokens/s (batch 1, greedy, the medians of
interleaved repeats, as ``compare`` times them) and its accuracy against the float32 PyTorch
module (``parity/accuracy.py``): on a held-out text (``export/data/perplexity.txt`` unless
``--text``) the perplexity and its increase, the mean KL divergence of each position's
next-token distribution from float32's and the share of positions with float32's top token
(llama.cpp's ``llama-perplexity --kl-divergence``); and, when the source has a chat template,
the share of ``CHAT_QUESTIONS`` whose greedy answer is float32's, token for token. tfport's
exports are read through the runtime; an onnxruntime-genai directory's logits and answers come
from its own engine (``GenaiPeer``), a GGUF file's from llama.cpp. The front is drawn on one
metric (``--metric``: KL by default): a point is on it when no other point is at least as fast
and at least as accurate (and better in one); the report names, for each peer point, a tfport
point that is at least as fast and as accurate, if there is one, and the layout issue 43's rule
picks as the int4 default (``default_rule``). ``write_svg`` draws the points (no plotting library
needed).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tfport.files import write_text_atomic

from tfport.contract import ACTIVATIONS
from tfport.export.quant import BLOCK_SIZES, INT4, INT8, KEEP, W8A8_FORMAT
from .measurement import BenchSettings, load_average, machine_info, measure, time_tfport

log = logging.getLogger(__name__)

DEFAULT_LAYOUTS = ("default", "gptq32-sym-h8", "gptq64-sym-h8", "gptq128-sym", "rtn32-sym", "int8")
_LAYOUT = re.compile(r"(rtn|gptq)(\d+)-(sym|zp)(-h8)?(?:-hb(\d+))?")
# Layouts named alone -> their options: int4 as --quantize alone has it, the other formats
# round-to-nearest, keep a GGUF source's own blocks.
NAMED_LAYOUTS = {"default": {"quantize": INT4.name}, KEEP.name: {"quantize": KEEP.name},
                 **{fmt.name: {"quantize": fmt.name, "calibration": "none"} for fmt in (INT8, W8A8_FORMAT)}}
# A layout name's ending -> its activations (tfport export --activations float / mixed)
ACTIVATION_SUFFIXES = {f"-{activations}": activations for activations in ACTIVATIONS[1:]}


def layout_options(name: str) -> dict[str, Any]:
    """``ExportOptions`` fields of a layout name: "default" (``--quantize int4`` alone), "int8"
    (the int8 default: round-to-nearest, blocks of 32), "w8a8" (int8 weights and per-row
    activations, export/quant/w8a8.py), "keep" (a GGUF source's own blocks), or
    ``{rtn|gptq}{block}-{sym|zp}[-h8][-hb{block}]``: int4, round-to-nearest or GPTQ on the
    built-in text, that block size, symmetric or with zero points, the head and token table at 8
    bits with ``-h8``, in blocks of ``-hb`` (default: ``calibrate.head_block``); any of them
    ending in ``-float`` or ``-mixed`` on those activations (``--activations``)."""
    for suffix, activations in ACTIVATION_SUFFIXES.items():
        base = name.removesuffix(suffix)
        if base != name and base and not base.endswith(tuple(ACTIVATION_SUFFIXES)):
            return {**layout_options(base), "activations": activations}
    if name in NAMED_LAYOUTS:
        return dict(NAMED_LAYOUTS[name])
    match = _LAYOUT.fullmatch(name)
    if match is None or not {int(b) for b in (match[2], match[5]) if b} <= set(BLOCK_SIZES):
        raise ValueError(f"--layouts {name!r}: expected {', '.join(NAMED_LAYOUTS)} or rtn|gptq, a block size "
                         f"({', '.join(map(str, BLOCK_SIZES))}), -sym or -zp, optionally -h8 and -hb with "
                         f"a block size, e.g. gptq32-sym-h8 or gptq128-sym-hb32; any of them may end in "
                         f"{' or '.join(ACTIVATION_SUFFIXES)} (their activations)")
    options = {"quantize": INT4.name, "block_size": int(match[2]), "symmetric": match[3] == "sym",
               "calibration": "none" if match[1] == "rtn" else "builtin"}
    if match[4]:
        options["head_bits"] = 8
    if match[5]:
        options["head_block_size"] = int(match[5])
    return options


@dataclass
class Point:
    """One engine x layout: decode speed and its accuracy against float32 (module doc)."""

    label: str
    engine: str  # "tfport" | "onnxruntime-genai" | "llama.cpp" | "float32" (tfport's float export)
    tokens_per_s: float
    perplexity: float
    increase: float  # perplexity / float32 perplexity - 1
    step_ms_repeats: list[float]
    kl_mean: float | None = None  # mean KL(float32 || this) per position of the text, nats
    top1: float | None = None  # share of the text's positions with float32's top token
    answers: float | None = None  # share of CHAT_QUESTIONS answered as float32 does (None: no template)
    on_front: bool = False
    matched_by: str | None = None  # a peer point: a tfport point at least as fast and accurate


METRICS = {  # --metric: a point's loss on the front's axis (lower is better), the axis label
    "kl": (lambda p: p.kl_mean, "mean KL divergence from float32 (nats)"),
    "perplexity": (lambda p: 100 * p.increase, "perplexity increase over float32 (%)"),
    "top1": (lambda p: 100 * (1 - p.top1), "positions whose top token is not float32's (%)"),
}


def check_metric(metric: str) -> None:
    """``ValueError`` naming ``--metric`` unless one of ``METRICS``."""
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r}: expected one of {', '.join(METRICS)}")


def loss(point: Point | dict, metric: str) -> float:
    """``point``'s loss in ``metric`` (``METRICS``), from a Point or its dict."""
    check_metric(metric)
    return METRICS[metric][0](point if isinstance(point, Point) else Point(**point))


def mark_front(points: list[Point], metric: str = "kl") -> None:
    """Set ``on_front`` (no other point at least as fast and as accurate in ``metric``, better
    in one) and, for every peer point, ``matched_by``: the fastest tfport point that is at least
    as fast and at least as accurate, if any."""
    def covers(a: Point, b: Point) -> bool:
        return a.tokens_per_s >= b.tokens_per_s and loss(a, metric) <= loss(b, metric)

    for p in points:
        p.on_front = not any(covers(q, p) and (q.tokens_per_s, loss(q, metric)) != (p.tokens_per_s, loss(p, metric))
                             for q in points if q is not p)
        if p.engine not in ("tfport", "float32"):
            matches = [q for q in points if q.engine == "tfport" and covers(q, p)]
            p.matched_by = max(matches, key=lambda q: q.tokens_per_s).label if matches else None


KEEPS_ANSWERS = 0.9  # the share of CHAT_QUESTIONS a default must answer as float32 does (9 of 10)


def default_rule(points: list[Point]) -> Point | None:
    """The tfport point issue 43's rule picks for ``--quantize int4``: of those at least as fast
    as every onnxruntime-genai point (the peer's default int4) that answer at least
    ``KEEPS_ANSWERS`` of the chat questions as float32 does, the lowest mean KL divergence; None
    when none qualifies or a point lacks the measures (no chat template, no KL)."""
    peers = [p.tokens_per_s for p in points if p.engine == "onnxruntime-genai"]
    floor = max(peers, default=0.0)
    fit = [p for p in points if p.engine == "tfport" and p.tokens_per_s >= floor
           and p.answers is not None and p.answers >= KEEPS_ANSWERS and p.kl_mean is not None]
    return min(fit, key=lambda p: p.kl_mean, default=None)


def run_pareto(settings: BenchSettings, source_name: str, layouts: tuple[str, ...] = DEFAULT_LAYOUTS,
               genai: tuple[str, ...] = (), gguf: tuple[str, ...] = (), text: str | None = None,
               include_float: bool = True, metric: str = "kl") -> dict[str, Any]:
    """Export ``source_name`` once per layout (the ``ort`` target unless ``settings.targets``
    names one), measure every side's accuracy on ``text`` (and on the chat questions, when the
    source has a chat template) and its decode speed (interleaved repeats), and return the points
    with the front marked on ``metric``."""
    from tokenizers import Tokenizer

    from tfport.export.exporter import export_model, source_options
    from tfport.export.options import ExportOptions
    from tfport.tools.parity import accuracy
    from tfport.export.source import load_source
    from .compare import peer_sides

    options = {name: layout_options(name) for name in layouts}
    check_metric(metric)
    if len(settings.targets) != 1:
        raise ValueError(f"--targets {','.join(settings.targets)}: the Pareto view exports to one target")
    load_before = load_average()
    source = load_source(source_name, settings.seed)
    if source.tokenizer is None:
        raise ValueError(f"--source {source_name!r}: perplexity needs the source's tokenizer.json")
    text_path = Path(text) if text else accuracy.PERPLEXITY_TEXT
    ids = np.array(Tokenizer.from_file(str(source.tokenizer)).encode(text_path.read_text(encoding="utf-8")).ids,
                   dtype=np.int64)
    reference_logits = accuracy.reference_logits(source.model, ids)
    reference = accuracy.perplexity(reference_logits, ids)
    log.info("pareto: float32 perplexity %.3f on %d tokens of %s", reference, len(ids), text_path.name)
    chat = None  # (prompts, stop ids, float32's answers)
    if source.chat_template:
        fmt = accuracy.source_chat_format(source.chat_template, source.tokenizer, source.model.config)
        prompts, stops = accuracy.chat_prompts(fmt), fmt.stop_ids
        chat = prompts, stops, accuracy.reference_answers(source.model, prompts, stops)
    from tfport.runtime import load_model

    sides, labels, engines, measures = [], [], [], []

    def measured(logits: np.ndarray, answers) -> dict[str, Any]:
        d = accuracy.divergence(reference_logits, logits)
        return {"perplexity": accuracy.perplexity(logits, ids), "kl_mean": d.kl_mean, "top1": d.top1,
                "answers": None if chat is None else accuracy.answer_agreement(chat[2], answers(*chat[:2]))}

    with tempfile.TemporaryDirectory(prefix="tfport-pareto-") as tmp:
        names = (["float32"] if include_float else []) + list(layouts)
        for name in names:
            out = Path(tmp) / name
            # as tfport export of the file: keep bound to it; int4 alone of a 4-bit file, its blocks
            export_model(source.model, out, source_options(ExportOptions(
                target=settings.targets[0], tokenizer=source.tokenizer, validate=False, **options.get(name, {})),
                source_name))
            measures.append(measured(accuracy.export_logits(out, ids),
                                     lambda prompts, stops, out=out: accuracy.export_answers(out, prompts, stops)))
            model = load_model(out, settings.provider, intra_op_threads=settings.threads)
            sides.append(lambda p, n, m=model: time_tfport(m, p, n))
            labels.append(f"tfport {name}")
            engines.append("float32" if name == "float32" else "tfport")
            log.info("pareto: %s %s", name, measures[-1])
        peers, skipped = peer_sides(settings, genai, gguf)
        for side in peers:
            measures.append(measured(side.run.logits(ids), lambda prompts, stops, run=side.run: [
                accuracy.cut_answer(run(np.array([p]), accuracy.ANSWER_TOKENS - 1).tokens[0], stops)
                for p in prompts]))
            sides.append(side.run)
            labels.append(side.label)
            engines.append(side.kind)
            log.info("pareto: %s %s", side.label, measures[-1])
        vocab = source.model.config.vocab_size
        prompts = np.random.default_rng(settings.seed).integers(min(100, vocab // 2), vocab,
                                                                size=(1, settings.contexts[0]))
        timings = measure([(lambda n, s=s: s(prompts, n)) for s in sides], settings.new_tokens,
                          settings.repeats, settings.settle_ms)
        del sides, peers
    points = []
    for label, engine, m, runs in zip(labels, engines, measures, timings):
        steps = [statistics.median(r.step_ms) for r in runs]
        points.append(Point(label, engine, 1e3 / statistics.median(steps), m["perplexity"],
                            m["perplexity"] / reference - 1, steps, m["kl_mean"], m["top1"], m["answers"]))
    mark_front(points, metric)
    chosen = default_rule(points)
    return {"format": "tfport-bench-pareto/2", "source": source_name, "text": text_path.name,
            "tokens": len(ids), "float32_perplexity": reference, "layouts": list(layouts), "metric": metric,
            "chat_questions": None if chat is None else len(chat[0]),
            "default_rule": None if chosen is None else chosen.label,
            "settings": dataclasses.asdict(settings),
            "machine": {**machine_info(settings), "load_average_before": load_before,
                        "load_average_after": load_average()},
            "points": [dataclasses.asdict(p) for p in points], "skipped": skipped}


def format_pareto(result: dict[str, Any]) -> str:
    """The points as a table, fastest first."""
    s = result["settings"]
    metric = result.get("metric", "kl")
    lines = [f"source {result['source']}: {result['tokens']} tokens of {result['text']} (float32 perplexity "
             f"{result['float32_perplexity']:.3f}); decode batch 1, prompt {s['contexts'][0]}, "
             f"{s['new_tokens']} steps x {s['repeats']} repeats, {s['threads']} threads, load average "
             f"{result['machine']['load_average_before']} -> {result['machine']['load_average_after']}; "
             f"front and matches on {metric}", ""]

    def share(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    table = [("point", "tokens/s", "perplexity", "vs float32", "KL", "top-1", "answers", "front",
              "matched by tfport")]
    for p in sorted(result["points"], key=lambda p: -p["tokens_per_s"]):
        matched = "" if p["engine"] in ("tfport", "float32") else (p["matched_by"] or "no")
        kl = "-" if p.get("kl_mean") is None else f"{p['kl_mean']:.4f}"
        table.append((p["label"], f"{p['tokens_per_s']:.1f}", f"{p['perplexity']:.3f}",
                      f"{100 * p['increase']:+.1f}%", kl, share(p.get("top1")), share(p.get("answers")),
                      "*" if p["on_front"] else "", matched))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    if result.get("chat_questions"):
        lines.append(f"answers: of {result['chat_questions']} chat questions, greedy answers equal to float32's")
        lines.append(f"issue 43's rule (at least every onnxruntime-genai point's speed, at least "
                     f"{KEEPS_ANSWERS:.0%} of float32's answers, then the lowest KL): "
                     f"{result.get('default_rule') or 'no tfport point qualifies'}")
    lines += [f"skipped: {reason}" for reason in result["skipped"]]
    return "\n".join(lines)


COLOURS = {"tfport": "#1f77b4", "float32": "#7f7f7f", "onnxruntime-genai": "#d62728", "llama.cpp": "#2ca02c"}


def write_svg(result: dict[str, Any], path: str | Path) -> str:
    """Tokens/s against the result's metric (``METRICS``; perplexity for a result from before
    there was a choice), one labelled point per engine x layout, tfport's front joined by a line;
    written atomically as SVG."""
    width, height, margin = 720, 440, 60
    points = result["points"]
    metric = result.get("metric", "perplexity")
    xs = [loss(p, metric) for p in points]
    ys = [p["tokens_per_s"] for p in points]
    x0 = min(xs) if min(xs) < -0.5 else 0.0  # float32's own -0.0001% (or KL 1e-7) is drawn at 0
    x1 = max(xs) * 1.08 + 1e-9
    y0, y1 = 0.0, max(ys) * 1.12

    def sx(x: float) -> float:
        return margin + (x - x0) / (x1 - x0) * (width - 2 * margin)

    def sy(y: float) -> float:
        return height - margin - (y - y0) / (y1 - y0) * (height - 2 * margin)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" y2="{height - margin}" stroke="black"/>',
             f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">{METRICS[metric][1]}, '
             f'{_escape(result["text"])}</text>',
             f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">'
             'decode tokens/s (batch 1)</text>']
    for tick in np.linspace(x0, x1, 6):
        label = f"{tick:.0f}" if x1 - x0 >= 5 else f"{tick:.2g}"
        parts.append(f'<text x="{sx(tick):.1f}" y="{height - margin + 15}" text-anchor="middle">{label}</text>')
    for tick in np.linspace(y0, y1, 6):
        parts.append(f'<text x="{margin - 6}" y="{sy(tick) + 4:.1f}" text-anchor="end">{tick:.0f}</text>')
    front = sorted((p for p in points if p["engine"] == "tfport" and p["on_front"]), key=lambda p: loss(p, metric))
    if len(front) > 1:
        path_points = " ".join(f"{sx(loss(p, metric)):.1f},{sy(p['tokens_per_s']):.1f}" for p in front)
        parts.append(f'<polyline points="{path_points}" fill="none" stroke="{COLOURS["tfport"]}" '
                     'stroke-dasharray="4 3"/>')
    for p, x, y in zip(points, xs, ys):
        colour = COLOURS.get(p["engine"], "black")
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="{colour}"/>')
        right = sx(x) > width / 2  # the label on the point's left, so that it stays inside the plot
        offset, anchor = (-6, ' text-anchor="end"') if right else (6, "")
        parts.append(f'<text x="{sx(x) + offset:.1f}" y="{sy(y) - 6:.1f}" fill="{colour}"{anchor}>'
                     f'{_escape(p["label"])}</text>')
    parts.append("</svg>")
    write_text_atomic(path, "\n".join(parts) + "\n")
    return str(path)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
