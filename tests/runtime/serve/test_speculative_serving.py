"""``tfport serve --speculative``: the server returns the same tokens with speculation on and off,
with 16 concurrent requests over continuous batching, and reports the proposals it made per
request (``usage.speculative``) and in ``/metrics``."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

from tests.runtime.serve.conftest import running_server
from tfport.runtime import load_model
from tfport.runtime.decoding.policy import VerifyCosts


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(count):
        base = rng.integers(4, 96, size=int(rng.integers(3, 7))).tolist()
        out.append(base * (1 + i % 3))  # some repeat themselves: prompt lookup finds matches
    return out


@pytest.mark.parametrize("name", ["dec-portable", "dec-ort"])
def test_speculation_on_returns_the_tokens_of_speculation_off(serve_exports, name, monkeypatch):
    # Verification priced as a single step: K stays at its maximum (the measured cost, on a loaded
    # machine, can turn speculation off and leave nothing proposed to check).
    from tfport.runtime.decoding import speculative as spec
    monkeypatch.setattr(spec, "measure_costs", lambda batch, k_max, repeats=3: VerifyCosts({1: 1e-3}, learn=False))
    prompts = _prompts(16)
    model = load_model(serve_exports[name], intra_op_threads=1)
    expected = [model.generate([p], max_new_tokens=20, stop_token_ids=())[0].tolist() for p in prompts]

    def ask(url: str, prompt: list[int]) -> dict:
        response = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": name, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()

    for speculative in (None, "lookup"):
        with running_server([serve_exports[name]], max_rows=6, speculative=speculative) as (url, _):
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda p: ask(url, p), prompts))
            metrics = httpx.get(url + "/metrics").text
        assert [a["choices"][0]["token_ids"] for a in answers] == expected, speculative
        if speculative is None:
            assert all("speculative" not in a["usage"] for a in answers)
            continue
        proposed = sum(a["usage"]["speculative"]["proposed"] for a in answers)
        accepted = sum(a["usage"]["speculative"]["accepted"] for a in answers)
        assert proposed > 0 and 0 < accepted <= proposed
        assert f'tfport_speculative_proposed_tokens_total{{model="{name}"}} {float(proposed)}' in metrics
        assert f'tfport_speculative_accepted_tokens_total{{model="{name}"}} {float(accepted)}' in metrics
