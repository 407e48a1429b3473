"""The decoders people deploy (issue #12), exported to every target that takes them, against
transformers: the raw decoder graph (prefill of a left- and a right-padded batch, decode steps on
the cache, a multi-token chunk on a past) and the runtime's greedy tokens, with prompts longer
than the sliding window of the cases that have one.

The raw-graph checks drive ``decoder.onnx`` with ONNX Runtime directly, as another runtime would
(targets whose cache layout is ``concat``); the ``inplace`` layout (target ``ort``) is driven by
tfport's runtime, and its graph is checked against the reference module at export.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tfport.contract import LAST_LOGITS
from tfport.export import ExportOptions, export_model
from tfport.export.targets import TARGETS
from tfport.manifest import Manifest
from tfport.models.positions import positions_from_mask
from tfport.runtime import load_model

from .cases import CASES, WINDOW, assert_close, batch, hf_decoder_step

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")

DEPLOYED = [name for name, case in CASES.items() if case.per_target]
PROMPT = WINDOW + 3  # every prompt runs past the sliding window


def _targets(name: str) -> list:
    return [pytest.param(name, target, id=f"{name}-{target}") for target in TARGETS]


ALL = [p for name in DEPLOYED for p in _targets(name)]


@pytest.fixture(scope="session")
def exported(imported, tmp_path_factory):
    """``exported(name, target)`` -> (Imported, export directory, Manifest), cached."""
    cache: dict = {}

    def get(name: str, target: str):
        if (name, target) not in cache:
            it = imported(name)
            try:
                TARGETS[target].check(it.model.config, "float32", TARGETS[target].default_opset)
            except ValueError as err:
                pytest.skip(f"target {target!r} refuses {name}: {err}")
            out = tmp_path_factory.mktemp(f"export-{name}-{target}") / "export"
            # concat-layout graphs are compared with transformers directly below; the export-time
            # check against the module is kept where the runtime is the only driver (inplace).
            validate = TARGETS[target].layout != "concat"
            options = ExportOptions(target=target, validate=validate)
            cache[name, target] = (it, out, export_model(it.model, out, options))
        return cache[name, target]

    return get


def _concat_session(exported, name: str, target: str):
    it, out, manifest = exported(name, target)
    if manifest.layout != "concat":
        pytest.skip(f"target {target!r} uses the {manifest.layout!r} cache layout, driven by the "
                    "runtime (test_runtime_greedy) and checked against the module at export")
    session = ort.InferenceSession(str(out / manifest.graphs["decoder"].file), providers=["CPUExecutionProvider"])
    return it, manifest, session


def _run(session, manifest: Manifest, ids: torch.Tensor, mask: torch.Tensor, past: list | None):
    """Logits [B, S, V] and presents of one graph call; ``past`` None is an empty cache."""
    config = manifest.config
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
             "position_ids": positions_from_mask(mask, ids.shape[1]).numpy(), LAST_LOGITS: np.array(False)}
    empty = np.zeros((ids.shape[0], config.kv_heads, 0, config.dim_per_head), np.float32)
    for i in range(config.n_decoder_layers):
        for j, part in enumerate(("key", "value")):
            feeds[f"past_key_values.{i}.{part}"] = empty if past is None else past[2 * i + j]
    outputs = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    logits = outputs[names.index("logits")]
    presents = [outputs[names.index(f"present.{i}.{part}")]
                for i in range(config.n_decoder_layers) for part in ("key", "value")]
    return logits, presents


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name,target", ALL)
def test_graph_prefill(exported, name, target, padding):
    it, manifest, session = _concat_session(exported, name, target)
    ids, mask = batch(padding, seed=21, length=PROMPT)
    logits, _ = _run(session, manifest, ids, mask, None)
    expected, _ = hf_decoder_step(it.hf, it.case, ids, mask)
    assert_close(logits, expected, mask.bool().numpy(), f"{name} {target} prefill ({padding} padding)")


@pytest.mark.parametrize("name,target", ALL)
def test_graph_decode_and_chunk(exported, name, target):
    """Left-padded prefill, three single-token steps, then a chunk of three tokens on that past:
    every call runs past the sliding window."""
    it, manifest, session = _concat_session(exported, name, target)
    ids, mask = batch("left", seed=22, length=PROMPT)
    logits, past = _run(session, manifest, ids, mask, None)
    _, cache = hf_decoder_step(it.hf, it.case, ids, mask)
    for step in range(3):
        token = torch.from_numpy(logits[:, -1].argmax(-1))[:, None]  # [B, 1]
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits, past = _run(session, manifest, token, mask, past)
        expected, cache = hf_decoder_step(it.hf, it.case, token, mask, cache)
        assert_close(logits, expected, np.ones((2, 1), bool), f"{name} {target} decode step {step}")
    chunk = torch.randint(3, 96, (2, 3), generator=torch.Generator().manual_seed(23))
    mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
    logits, _ = _run(session, manifest, chunk, mask, past)
    expected, _ = hf_decoder_step(it.hf, it.case, chunk, mask, cache)
    assert_close(logits, expected, np.ones((2, 3), bool), f"{name} {target} chunk on a past")


def _hf_greedy(it, prompts: list[list[int]], steps: int) -> np.ndarray:
    """transformers' greedy tokens [B, steps] for left-padded ``prompts`` (KV cache, positions
    counted over real tokens)."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    logits, cache = hf_decoder_step(it.hf, it.case, ids, mask)
    tokens = []
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits, cache = hf_decoder_step(it.hf, it.case, token, mask, cache)
    return torch.cat(tokens, dim=1).numpy()


@pytest.mark.parametrize("name,target", ALL)
def test_runtime_greedy(exported, name, target):
    """``load_model(...).generate`` (any cache layout) gives transformers' greedy tokens on a
    ragged batch whose prompts and generations run past the sliding window."""
    it, out, _ = exported(name, target)
    prompts = [list(range(5, 5 + PROMPT)), list(range(40, 40 + PROMPT - 2))]
    steps = WINDOW + 2
    tokens = load_model(out).generate(prompts, max_new_tokens=steps, stop_token_ids=())
    np.testing.assert_array_equal(tokens, _hf_greedy(it, prompts, steps), err_msg=f"{name} {target}")


def test_generation_config_eos_list_and_defaults(imported, tmp_path):
    """A checkpoint whose generation_config.json lists several eos ids (as Llama 3 Instruct's
    does) and sampling defaults: the export keeps them all, generation stops on any of them
    unless the caller overrides, and the sampling defaults apply when none are given."""
    import json
    import shutil
    import subprocess
    import sys

    from tfport.export import ExportOptions, export_checkpoint_or_preset
    from tfport.generation import GENERATION_CONFIG_FILE

    it = imported("llama3")
    prompts = [list(range(5, 5 + PROMPT))]
    first = int(_hf_greedy(it, prompts, 1)[0, 0])  # row 0's first greedy token becomes an eos id
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(it.directory, checkpoint)
    (checkpoint / GENERATION_CONFIG_FILE).write_text(json.dumps(
        {"eos_token_id": [2, first, 9], "do_sample": False, "temperature": 0.6, "top_p": 0.9}))
    out = tmp_path / "export"
    export_checkpoint_or_preset(str(checkpoint), out, ExportOptions(validate=False))
    model = load_model(out)
    assert model.stop_ids() == (2, first, 9)
    assert model.sampling() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}  # do_sample false
    tokens = model.generate(prompts, max_new_tokens=3)
    assert tokens.shape == (1, 1) and tokens[0, 0] == first  # stopped on the second eos id
    assert model.generate(prompts, max_new_tokens=3, stop_token_ids=()).shape == (1, 3)
    # tfport generate --stop overrides the export's stop ids
    cli = [sys.executable, "-m", "tfport", "generate", str(out), "--ids", ",".join(map(str, prompts[0])),
           "--max-new-tokens", "3"]
    default = subprocess.run(cli, capture_output=True, text=True, check=True).stdout.split()
    assert default == [str(first)]
    overridden = subprocess.run(cli + ["--stop", "2"], capture_output=True, text=True, check=True).stdout.split()
    assert len(overridden[0].split(",")) == 3
    sampled = json.loads((checkpoint / GENERATION_CONFIG_FILE).read_text())
    (checkpoint / GENERATION_CONFIG_FILE).write_text(json.dumps({**sampled, "do_sample": True}))
    export_checkpoint_or_preset(str(checkpoint), tmp_path / "sampled", ExportOptions(validate=False))
    assert load_model(tmp_path / "sampled").sampling() == {"temperature": 0.6, "top_k": 50, "top_p": 0.9}
