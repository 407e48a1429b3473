"""ONNX Runtime (CPU and CUDA providers) against the PyTorch reference, over the whole matrix:
family x position x attention x padding (none/left/right) x phase (prefill, decode with past,
a chunk on top of a past) x provider x dtype. Logits/hidden states and present K/V are compared
at real positions only, with the tolerance table in tfport.export.parity.TOLERANCES; a failure
names the first diverging layer and piece."""

from __future__ import annotations

import pytest
import torch

from tests.matrix import target_matrix
from tfport.export.parity import CASES, TOLERANCES, Runner, first_divergence, localize, reference_module
from tfport.export.targets import TARGETS
from tfport.models.generate import generate, generate_seq2seq
from tfport.runtime import load_model

from .conftest import PROVIDER_DTYPES


def _params(decoders_only: bool = False) -> list:
    """(target, config, provider, dtype) over every registered target x the matrix entries it
    takes x provider/dtype; a combination the target refuses on a device (its manifest's
    device refusals) is an expected failure with the target's reason."""
    params = []
    for name, target in TARGETS.items():
        for (family, position, attention), config in target_matrix(target):
            if decoders_only and family == "encoder":
                continue
            for p in PROVIDER_DTYPES:
                provider, dtype = p.values
                marks = list(p.marks)
                refusal = target.device_refusals(dtype).get(provider)
                if refusal is not None:
                    marks.append(pytest.mark.xfail(reason=refusal, strict=False))
                params.append(pytest.param(name, config, provider, dtype, marks=marks,
                                           id=f"{name}-{family}-{position}-{attention}-{p.id}"))
    return params


@pytest.mark.parametrize("target,config,provider,dtype", _params())
def test_outputs_match(exported, target, config, provider, dtype):
    """Every output of every case (prefill, decode, chunk x padding) at real positions."""
    check_outputs(*exported(config, dtype, target), provider)


def check_outputs(model, out, provider: str) -> None:
    runner = Runner(model, out, provider)
    failures = []
    for case in CASES:
        results = runner.run(case)
        if not all(r.ok for r in results):
            failures.append(f"{'; '.join(r.describe() for r in results if not r.ok)}\n"
                            f"    first divergence: {first_divergence(localize(runner, case))}")
        for result in results:
            for diff in result.diffs:
                if diff.token_agreement is not None:
                    assert diff.token_agreement == 1.0, f"argmax differs: {result.describe()}"
    assert not failures, "\n".join(failures)


def _reference_logits(model, prompt: torch.Tensor, tokens: list[int], encoder_ids=None) -> torch.Tensor:
    """Teacher-forced reference logits [V] for the position after prompt + tokens."""
    with torch.no_grad():
        if encoder_ids is not None:
            start = torch.tensor([[model.config.decoder_start_token_id] + tokens])
            return model(encoder_ids, start)[0, -1]
        return model(torch.cat([prompt, torch.tensor([tokens], dtype=torch.long)], dim=1))[0][0, -1]


def assert_greedy_agrees(model, expected: list[int], actual: list[int], prompt, tie: float,
                         encoder_ids=None) -> None:
    """Tokens must be equal until the end, or until a step where the runtime's token has a
    reference logit within ``tie`` of the reference's best (a near-tie: either choice is correct
    at this precision, and the continuations may then legitimately differ)."""
    for step, (e, a) in enumerate(zip(expected, actual)):
        if e == a:
            continue
        logits = _reference_logits(model, prompt, expected[:step], encoder_ids)
        gap = float(logits.max() - logits[a])
        assert gap <= tie, (f"greedy token {step} differs: reference {e}, runtime {a}, whose reference "
                            f"logit is {gap:.3g} below the best > near-tie threshold {tie}")
        return


@pytest.mark.parametrize("target,config,provider,dtype", _params(decoders_only=True))
def test_greedy_tokens_match(exported, target, config, provider, dtype):
    """The runtime's greedy tokens for a padded batch equal the reference's, row by row."""
    check_greedy(*exported(config, dtype, target), config.family, provider, dtype)


def check_greedy(model, out, family: str, provider: str, dtype: str, kv_dtype: str | None = None,
                 tolerance: tuple[float, float] | None = None) -> None:
    """The runtime's greedy tokens against the reference in ``dtype`` (a copy: the export cache
    shares the float32 module) whose cache is rounded to ``kv_dtype`` as the export's is."""
    model = reference_module(model, dtype, kv_dtype)
    runtime = load_model(out, provider=provider)
    prompts = [[5, 17, 33, 8, 61], [44, 9], [70, 2, 91, 12], [30, 31, 32, 33, 34, 35, 36]]
    steps = 10
    # The runtime decodes the prompts as one left-padded batch; the reference runs each alone.
    actual = runtime.generate(prompts, max_new_tokens=steps, stop_token_ids=())
    assert actual.shape == (len(prompts), steps)
    rtol, atol = tolerance or TOLERANCES[(dtype, provider)]
    seen = set()
    for row, ids in enumerate(prompts):
        prompt = torch.tensor([ids])
        if family == "decoder":
            expected = generate(model, prompt, max_new_tokens=steps)[0].tolist()
        else:
            expected = generate_seq2seq(model, prompt, max_new_tokens=steps)[0].tolist()
        seen.update(expected)
        assert_greedy_agrees(model, expected, actual[row].tolist(), prompt, tie=atol + rtol,
                             encoder_ids=prompt if family != "decoder" else None)
    assert len(seen) >= 4, f"reference outputs too uniform to test anything: {sorted(seen)}"


def test_near_tie_rule_rejects_a_real_difference():
    """The greedy checker must fail when tokens differ without a near-tie."""
    from tfport.models import build_model
    from tests.matrix import FAMILY_BASE

    model = build_model(FAMILY_BASE["decoder"], seed=3)
    prompt = torch.tensor([[5, 17, 33]])
    expected = generate(model, prompt, max_new_tokens=4)[0].tolist()
    logits = _reference_logits(model, prompt, [])
    wrong = int(logits.argsort()[0])  # the least likely token
    with pytest.raises(AssertionError, match="greedy token 0 differs"):
        assert_greedy_agrees(model, expected, [wrong] + expected[1:], prompt, tie=1e-4)
