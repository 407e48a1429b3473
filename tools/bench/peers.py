"""Other CPU inference engines timed on the same weights and prompts: onnxruntime-genai and
llama.cpp (llama-cpp-python). Both are optional: a peer whose module is not importable is skipped
with the reason (they are not dependencies of tfport; ``pip install onnxruntime-genai`` or
``llama-cpp-python`` adds the column).

Each peer is opened once and gives a ``run(prompts, steps) -> RunTiming`` like ``time_tfport``:
prefill is the time from handing over the prompt to having the first greedy token, each step the
time for one more token. Batch 1 only (``prompts`` int64 [1, C]).

Threads: onnxruntime-genai's generated ``genai_config.json`` leaves ``intra_op_num_threads``
unset (ONNX Runtime's default then spins one thread per core and more, which cost it ~30% on the
2-core VM); ``GenaiPeer`` sets it to the bench's thread count through a config overlay, so every
engine runs with the same number of threads.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from .measurement import RunTiming


def available(module: str) -> str | None:
    """None if ``module`` can be imported, else why not (the skip reason)."""
    if importlib.util.find_spec(module) is None:
        return f"module {module!r} is not installed"
    return None


class GenaiPeer:
    """An onnxruntime-genai model directory (its builder's output), greedy, ``threads`` intra-op."""

    name = "onnxruntime-genai"

    def __init__(self, model_dir: str | Path, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        overlay = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                             "inter_op_num_threads": 1}}}}
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)

    def __call__(self, prompts: np.ndarray, steps: int) -> RunTiming:
        og = self.og
        assert prompts.shape[0] == 1, "peers run batch 1"
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=prompts.shape[1] + steps + 2,
                                  min_length=prompts.shape[1] + steps + 2)
        generator = og.Generator(self.model, params)
        tokens, times = [], []
        start = time.perf_counter()
        generator.append_tokens(prompts[0].astype(np.int32))  # runs the prompt
        generator.generate_next_token()  # picks the first token from the prompt's logits
        tokens.append(int(generator.get_next_tokens()[0]))
        prefill = time.perf_counter() - start
        for _ in range(steps):
            start = time.perf_counter()
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            times.append(time.perf_counter() - start)
        return RunTiming(prefill * 1e3, [t * 1e3 for t in times], np.array([tokens]))

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """The engine's logits [S, V] for one sequence ``ids`` [S] (one prefill)."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + 1)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.asarray(ids, dtype=np.int32)[None])
        logits = np.asarray(generator.get_output("logits"), dtype=np.float32)  # [1, S, V]
        if logits.shape[:2] != (1, len(ids)):
            raise RuntimeError(f"onnxruntime-genai returned logits of shape {logits.shape} for "
                               f"{len(ids)} tokens (expected every position's)")
        return logits[0]


class LlamaCppPeer:
    """A GGUF file under llama.cpp (llama-cpp-python), greedy, ``threads`` for decode and batch."""

    name = "llama.cpp"

    def __init__(self, gguf: str | Path, threads: int, context: int = 2048):
        from llama_cpp import Llama

        self.gguf, self.threads = str(gguf), threads
        self.llm = Llama(self.gguf, n_threads=threads, n_threads_batch=threads, n_ctx=context,
                         n_batch=512, verbose=False, logits_all=False)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """llama.cpp's logits [S, V] for one sequence ``ids`` [S] (a context that keeps every
        position's logits, opened for this and closed after)."""
        from llama_cpp import Llama

        llm = Llama(self.gguf, n_threads=self.threads, n_threads_batch=self.threads, n_ctx=len(ids) + 8,
                    n_batch=512, verbose=False, logits_all=True)
        try:
            llm.eval([int(i) for i in ids])
            return np.array(llm.scores[:len(ids)], dtype=np.float32)
        finally:
            llm.close()

    def _argmax(self) -> int:
        """Greedy token from the last evaluated position's logits (llama.cpp's own buffer: with
        ``logits_all=False`` llama-cpp-python leaves ``scores`` unset)."""
        import llama_cpp

        logits = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def __call__(self, prompts: np.ndarray, steps: int) -> RunTiming:
        assert prompts.shape[0] == 1, "peers run batch 1"
        llm = self.llm
        llm.reset()
        tokens, times = [], []
        start = time.perf_counter()
        llm.eval(prompts[0].tolist())
        token = self._argmax()
        tokens.append(token)
        prefill = time.perf_counter() - start
        for _ in range(steps):
            start = time.perf_counter()
            llm.eval([token])
            token = self._argmax()
            tokens.append(token)
            times.append(time.perf_counter() - start)
        return RunTiming(prefill * 1e3, [t * 1e3 for t in times], np.array([tokens]))
