"""The runtime works in a process where torch, onnx and onnxscript cannot be imported.

The parent exports one model of each family; a subprocess whose PYTHONPATH starts with fake
``torch``, ``onnx`` and ``onnxscript`` packages (each raising ImportError) loads them, generates
and embeds, and runs the ``tfport generate`` command; its results must equal the parent's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

BLOCKED = ("torch", "onnx", "onnxscript")
KEYS = ("decoder-rope", "decoder-alibi", "encoder-decoder", "encoder")
PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 3]]

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tfport.runtime import load_model

    dirs = json.loads(sys.argv[1])
    prompts = json.loads(sys.argv[2])
    results = {}
    for key, path in dirs.items():
        model = load_model(path, "cpu")
        if model.config.family == "encoder":
            results[key] = model.embed(prompts, pooling="mean", normalize=True).tolist()
        else:
            greedy = model.generate(prompts, max_new_tokens=16, stop_token_ids=())
            sampled = model.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1)
            results[key] = [greedy.tolist(), sampled.tolist()]
    blocked = {"torch", "onnx", "onnxscript"}
    results["leaked"] = sorted(name for name in sys.modules
                               if name.split(".")[0] in blocked
                               or name.startswith(("tfport.models", "tfport.export")))
    print(json.dumps(results))
""")


def blocked_env(tmp_path) -> dict:
    fake = tmp_path / "fake-packages"
    for name in BLOCKED:
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: the tfport runtime must not import it')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_fake_packages_block(tmp_path):
    env = blocked_env(tmp_path)
    for name in BLOCKED:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], env=env,
                              capture_output=True, text=True)
        assert proc.returncode != 0 and "is blocked" in proc.stderr


def test_runtime_without_torch(tmp_path, loaded):
    models = {key: loaded(key) for key in KEYS}
    dirs = {key: str(exported.path) for key, (exported, _) in models.items()}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(dirs), json.dumps(PROMPTS)],
                          env=blocked_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert results.pop("leaked") == []
    for key, (_, model) in models.items():
        if model.config.family == "encoder":
            np.testing.assert_allclose(results[key], model.embed(PROMPTS, normalize=True),
                                       rtol=1e-6)
        else:
            greedy, sampled = results[key]
            np.testing.assert_array_equal(
                greedy, model.generate(PROMPTS, max_new_tokens=16, stop_token_ids=()))
            np.testing.assert_array_equal(
                sampled,
                model.generate(PROMPTS, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1))


def test_cli_without_torch(tmp_path, loaded):
    exported, model = loaded("encoder-decoder")
    proc = subprocess.run([sys.executable, "-m", "tfport", "generate", str(exported.path),
                           "--ids", "1,5,7,9,11", "--max-new-tokens", "8", "--stream"],
                          env=blocked_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tokens = model.generate([PROMPTS[0]], max_new_tokens=8)[0]
    assert proc.stdout.strip() == ",".join(map(str, tokens))
