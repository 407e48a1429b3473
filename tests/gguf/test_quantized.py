"""Quantised SmolLM2-135M-Instruct against its own float32 weights: the issue's accuracy targets
on real weights, measured through the export as shipped (the ``ort`` target, MatMulNBits at
accuracy level 4: int8 activations; w8a8's MatMulInteger on activations rounded per row) and the
torch-free runtime.

Perplexity is read on the fixed text ``tfport parity --accuracy`` uses
(``tools/data/perplexity.txt``, 1,844 SmolLM2 tokens, which calibration never reads), against the
float32 PyTorch module's perplexity on the same ids. The bounds are the targets, not the measured
values (docs/quantisation.md#the-defaults, docs/benchmarks.md): GPTQ int4 (blocks of 32, the int4
default of a float source, measured +8.6%) and w8a8 (+5.3%) within 10%; int8 (+0.1%) within 3%; the int4 default of this 4-bit file (its own blocks on mixed
activations, ``exporter.source_options``: +0.05%) within 1%. Beside perplexity, both int4 layouts
are held to float32's greedy chat answers and to bounds on the KL divergence and top-1 agreement
(issue 43), on the same exports.
A regression in the quantiser, the calibration or a lowering moves them past the bound (int4
with the head at int8, +6.7%, only makes GPTQ's head more precise: its run here, 50 s of the
suite's time, was dropped; `--head-bits` is tested on tiny models). The
exactness of each graph against its own dequantised weights is tested on tiny models
(tests/export/test_quantize.py, test_calibrate.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tfport.export import ExportOptions, export_model, source_options
from tfport.manifest import Manifest
from tfport.tools.parity.accuracy import (PERPLEXITY_TEXT, answer_agreement, chat_prompts, divergence,
                                           export_answers, export_chat_format, export_logits, perplexity,
                                           reference_answers, reference_logits)

from .smollm2 import smollm2_path

# (quantize, calibration, head_bits, bound on perplexity / float32 perplexity), each exported as
# ``tfport export`` of the GGUF file would (``source_options``)
SCHEMES = {
    "int8 round-to-nearest": ("int8", "none", None, 1.03),
    "int4 GPTQ (blocks of 32)": ("int4", "builtin", None, 1.10),  # the int4 default of a float source
    "w8a8 (int8 activations per row)": ("w8a8", "none", None, 1.10),  # measured +5.3%; one scale per step: +71%
    "int4 default (the file's blocks)": ("int4", "auto", None, 1.01),  # what --quantize int4 alone gives: +0.05%
}
DEFAULT = "int4 default (the file's blocks)"
GPTQ = "int4 GPTQ (blocks of 32)"
# The default: the file's own blocks with float activations for the qkv and down products
# (measured on an Intel Xeon with AVX-512 VNNI: 9 of 10 answers, KL 0.0015, top-1 97.0%; on int8
# activations throughout, 7 of 10 and KL 0.0026): one answer of margin below issue 43's 9 of 10
# for a kernel that rounds a near tie the other way, and a KL bound that int8 activations
# throughout would break.
DEFAULT_ANSWERS, DEFAULT_KL, DEFAULT_TOP1 = 0.8, 0.003, 0.95
# GPTQ int4's bounds on the held-out text (measured on an Intel Xeon with AVX-512 VNNI: KL 0.082,
# top-1 80.2%): tighter than onnxruntime-genai's default int4 (KL 0.36, top-1 63.8%) and than
# blocks of 128, the default before (KL 0.123), so either regression fails. Chat answers: 5 of 10
# (and the README's example); blocks of 128 kept none; one answer of margin.
GPTQ_KL, GPTQ_TOP1, GPTQ_ANSWERS = 0.11, 0.76, 0.4


@pytest.fixture(scope="module")
def text_ids(smollm2):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smollm2.tokenizer)).encode(PERPLEXITY_TEXT.read_text()).ids
    return np.array(ids, dtype=np.int64)


@pytest.fixture(scope="module")
def float_logits(smollm2, text_ids):
    return reference_logits(smollm2.model, text_ids)


@pytest.fixture(scope="module")
def float_perplexity(float_logits, text_ids):
    return perplexity(float_logits, text_ids)


@pytest.fixture(scope="module")
def hessians_once():
    """GPTQ's Hessians collected once for this module's calibrated exports: the same module and
    calibration text give the same Hessians (20 of a calibrated export's 40 s alone on a 2-core
    VM), and each export still runs GPTQ, the export and the runtime. They are released with the
    module (about 1.1 GB in float64)."""
    from tfport.export import calibrate

    collect, kept = calibrate.collect_hessians, {}

    def once(model, sequences, progress=False, names=None):
        key = (id(model), None if names is None else tuple(sorted(names)), tuple(s.tobytes() for s in sequences))
        if key not in kept:
            kept[key] = collect(model, sequences, progress, names)
        return kept[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "collect_hessians", once)
        yield
    kept.clear()


@pytest.fixture(scope="module")
def exported(smollm2, text_ids, hessians_once, tmp_path_factory):
    """``exported(name)``: the export of ``SCHEMES[name]``, made once per module, so the answers
    test reads the same int4 default export as the perplexity test."""
    made = {}

    def export(name: str):
        if name not in made:
            quantize, calibration, head_bits, _ = SCHEMES[name]
            out = tmp_path_factory.mktemp("quantized") / "export"
            options = ExportOptions(target="ort", quantize=quantize, head_bits=head_bits, calibration=calibration,
                                    tokenizer=smollm2.tokenizer, chat_template=smollm2.chat_template,
                                    validate=False)
            export_model(smollm2.model, out, source_options(options, str(smollm2_path())))
            made[name] = out
        return made[name]

    return export


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantised_perplexity_meets_the_target(name, text_ids, float_perplexity, exported):
    bound = SCHEMES[name][-1]
    quantized = perplexity(export_logits(exported(name), text_ids), text_ids)
    ratio = quantized / float_perplexity
    print(f"{name}: perplexity {quantized:.3f} vs float32 {float_perplexity:.3f} ({ratio:.3f}x)")
    assert np.isfinite(quantized)
    assert 1.0 / bound < ratio <= bound, f"{name}: perplexity {quantized:.3f} is {ratio:.3f}x float32's"


@pytest.fixture(scope="module")
def float_answers(smollm2, exported):
    """(the chat questions' prompts, float32's greedy answers to them, the chat format)."""
    fmt = export_chat_format(exported(DEFAULT))
    prompts = chat_prompts(fmt)
    return prompts, reference_answers(smollm2.model, prompts, fmt.stop_ids), fmt


def _answers(name: str, exported, float_answers):
    """(float32's greedy answers, the export ``name``'s, the tokenizer)."""
    prompts, expected, fmt = float_answers
    got = export_answers(exported(name), prompts, fmt.stop_ids)
    print(f"{name}: answers " + "; ".join(f"{fmt.tokenizer.decode(list(g))!r} (float32 "
                                          f"{fmt.tokenizer.decode(list(e))!r})" for e, g in zip(expected, got)))
    return expected, got, fmt.tokenizer


def _holds(name: str, exported, float_answers, float_logits, text_ids, answers: float, kl: float, top1: float):
    """The export ``name`` answers the README's example greedily as the float32 module does, keeps
    at least ``answers`` of float32's other answers, and stays close to float32's next-token
    distributions on the held-out text (mean KL divergence, top-1 agreement)."""
    expected, got, tokenizer = _answers(name, exported, float_answers)
    assert tokenizer.decode(list(expected[0])) == "The capital of France is Paris."  # the README's example
    assert got[0] == expected[0], tokenizer.decode(list(got[0]))
    assert answer_agreement(expected, got) >= answers
    d = divergence(float_logits, export_logits(exported(name), text_ids))
    print(f"{name}: KL {d.kl_mean:.4f}, top-1 {d.top1:.1%}")
    assert d.kl_mean <= kl and d.top1 >= top1, d


def test_the_int4_default_keeps_float32s_answers(text_ids, float_logits, exported, float_answers):
    """Issue 43: ``--quantize int4`` alone of this Q4_1 file keeps its own blocks, on float
    activations for the qkv and down products (measured 9 of 10 answers, at 0.7x the decode speed
    of onnxruntime-genai's int4, which keeps none: docs/quantisation.md#the-defaults)."""
    quantization = Manifest.read(exported(DEFAULT)).quantization
    assert quantization["format"] == "keep" and quantization["activation_type"] == "mixed"
    _holds(DEFAULT, exported, float_answers, float_logits, text_ids, DEFAULT_ANSWERS, DEFAULT_KL, DEFAULT_TOP1)


def test_gptq_int4_keeps_its_share_of_float32s_answers(text_ids, float_logits, exported, float_answers):
    """GPTQ int4 in blocks of 32, the int4 default of a float source, re-quantising the file's
    weights: 5 of 10 answers, the peer's decode speed."""
    assert Manifest.read(exported(GPTQ)).quantization["method"] == "gptq"
    _holds(GPTQ, exported, float_answers, float_logits, text_ids, GPTQ_ANSWERS, GPTQ_KL, GPTQ_TOP1)
