"""``tfport bench``: decode speed of an export, against the PyTorch reference and the roofline.

One reference module is built from a preset (random weights from ``seed``) and exported once per
target; the same module is the PyTorch side. For each batch B and context C, both sides run a
prompt of C tokens (the prefill, timed) and then ``new_tokens`` greedy decode steps, each timed
while the cache already holds at least C tokens:

* tfport: ``Model.stream`` of ``tfport.runtime`` (what a user calls), so the figures include the
  runtime's own per-step work (mask, positions, IO binding, argmax over the logits);
* PyTorch: a plain loop ``logits, cache = module(token, mask, past_key_values=cache)`` under
  ``torch.no_grad`` with ``torch.set_num_threads`` equal to ONNX Runtime's intra-op threads.

Per cell: one untimed warm-up run per side, then ``repeats`` rounds of one timed run per side,
alternating so that load from other processes hits every side alike; a run's step time is the
median over its steps, a cell's the median over its runs (the machine may be shared and noisy).

The roofline: decoding is bound by reading the weights once per step, so with ``W`` bytes of
weights read per token (every parameter except gathered embedding tables; a tied LM head counts
its table once, as the head) and a memory read bandwidth ``BW``, batch B makes at most
``B * BW / W`` tokens/s. ``BW`` is the larger of a multi-threaded numpy read kernel and an ONNX
Runtime fp32 GEMV, both measured here with the same thread count (after the decode runs, so their
buffers do not count in the decode rows' peak RSS).

Modules: ``measurement`` (settings, memory marks, timed runs, rows), ``roofline`` (bandwidth,
weight and KV bytes, the roofline), ``report`` (the result, table, JSON, plot), ``run`` (one
benchmark run), ``rows`` (``tfport bench --rows``: which weight product a decode step with many
rows should run, and each one's memory; ``--rows-exports``: whole exports by rows), ``products``
(its one-node candidate graphs, their sessions and timed calls), ``pareto`` (``tfport bench
--pareto``: tokens/s against perplexity for tfport's quantised layouts and the peers), ``cli``
(``tfport bench``; ``python -m tfport.tools.bench``).

Shapes: B batch, C context (prompt length, then cached tokens), V vocabulary.
"""

from .measurement import (DEFAULT, PROVIDERS, QUICK, BenchSettings, MemoryMark, Row, RunTiming,
                          make_row, time_tfport, time_torch)
from .report import (JSON_FORMAT, BenchResult, Growth, Skipped, fill_comparisons, format_table,
                     step_growth, write_json, write_plot)
from .roofline import (Bandwidth, fill_roofline, kv_cache_bytes, measure_bandwidth,
                       weight_bytes_per_token)
from .run import run_benchmark

__all__ = [
    "DEFAULT", "JSON_FORMAT", "PROVIDERS", "QUICK", "Bandwidth", "BenchResult", "BenchSettings",
    "Growth", "MemoryMark", "Row", "RunTiming", "Skipped", "fill_comparisons",
    "fill_roofline", "format_table", "kv_cache_bytes", "make_row", "measure_bandwidth",
    "run_benchmark", "step_growth", "time_tfport", "time_torch",
    "weight_bytes_per_token", "write_json", "write_plot",
]
