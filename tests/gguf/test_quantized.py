"""Quantised SmolLM2-135M-Instruct against its own float32 weights: the issue's accuracy targets
on real weights, measured through the export as shipped (the ``ort`` target, MatMulNBits at
accuracy level 4: int8 activations; w8a8's MatMulInteger on activations rounded per row) and the
torch-free runtime.

Perplexity is read on the fixed text ``tfport parity --accuracy`` uses
(``tools/data/perplexity.txt``, 1,844 SmolLM2 tokens, which calibration never reads), against the
float32 PyTorch module's perplexity on the same ids. The bounds are the targets, not the measured
values (docs/quantisation.md#the-defaults, docs/benchmarks.md): the int4 default (blocks of 32,
measured +8.6%), int4 with the head at int8 (+6.7%) and w8a8 (+5.3%) within 10%; int8 (+0.1%)
within 3%. Beside perplexity, the int4 default is held to float32's greedy chat answers and to
bounds on the KL divergence and top-1 agreement (issue 43), on the same export, and so is the
file's own blocks on mixed activations (``--quantize keep --activations mixed``), the layout that
keeps 9 of 10 answers.
A regression in the quantiser, the calibration or a lowering moves them past the bound. The
exactness of each graph against its own dequantised weights is tested on tiny models
(tests/export/test_quantize.py, test_calibrate.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tfport.export import ExportOptions, export_model
from tfport.export.quant import KEEP
from tfport.tools.bench.pareto import KEEPS_ANSWERS
from tfport.tools.parity.accuracy import (PERPLEXITY_TEXT, answer_agreement, chat_prompts, divergence,
                                           export_answers, export_chat_format, export_logits, perplexity,
                                           reference_answers, reference_logits)

from .smollm2 import smollm2_path

# (quantize, calibration, head_bits, activations, bound on perplexity / float32 perplexity)
SCHEMES = {
    "int8 round-to-nearest": ("int8", "none", None, "int8", 1.03),
    "int4 default (GPTQ, blocks of 32)": ("int4", "auto", None, "int8", 1.10),  # what --quantize int4 alone gives
    "int4 --head-bits 8": ("int4", "auto", 8, "int8", 1.10),
    "w8a8 (int8 activations per row)": ("w8a8", "none", None, "int8", 1.10),  # measured +5.3%; one scale per step: +71%
    "keep --activations mixed": ("keep", "auto", None, "mixed", 1.01),  # the file's blocks: measured +0.05%
}
DEFAULT = "int4 default (GPTQ, blocks of 32)"
MIXED = "keep --activations mixed"
# The file's own blocks with float activations for the qkv and down products (measured on an
# Intel Xeon with AVX-512 VNNI: 9 of 10 answers, KL 0.0015, top-1 97.0%; on int8 activations
# throughout, 7 of 10 and KL 0.0026): one answer of margin, and a KL bound that int8
# activations throughout would break only with the answers.
MIXED_ANSWERS, MIXED_KL, MIXED_TOP1 = 0.8, 0.003, 0.95
# The default's bounds on the held-out text (measured on an Intel Xeon with AVX-512 VNNI: KL 0.082,
# top-1 80.2%): tighter than onnxruntime-genai's default int4 (KL 0.36, top-1 63.8%, issue 43's
# target) and than blocks of 128, the default before (KL 0.123), so either regression fails.
DEFAULT_KL, DEFAULT_TOP1 = 0.11, 0.76
# Chat answers equal to float32's: the default keeps 5 of 10 (and the README's example); blocks of
# 128 kept none. One answer of margin for a kernel that rounds a near tie the other way.
DEFAULT_ANSWERS = 0.4


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
            quantize, calibration, head_bits, activations, _ = SCHEMES[name]
            if quantize == KEEP.name:  # the file's own blocks
                quantize = KEEP.for_source(smollm2_path(), "float32")
            out = tmp_path_factory.mktemp("quantized") / "export"
            export_model(smollm2.model, out, ExportOptions(target="ort", quantize=quantize, head_bits=head_bits,
                                                           calibration=calibration, activations=activations,
                                                           tokenizer=smollm2.tokenizer,
                                                           chat_template=smollm2.chat_template, validate=False))
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


@pytest.fixture(scope="module")
def default_answers(exported, float_answers):
    """(float32's greedy answers to the chat questions, the int4 default's, the tokenizer)."""
    return _answers(DEFAULT, exported, float_answers)


def test_the_int4_default_answers_as_float32_does(text_ids, float_logits, exported, default_answers):
    """Issue 43: the int4 default (the export the perplexity test made) answers the README's
    example greedily as the float32 module does, keeps its share of float32's other answers,
    and stays close to float32's next-token distributions on the held-out text (mean KL
    divergence, top-1 agreement)."""
    expected, got, tokenizer = default_answers
    assert tokenizer.decode(list(expected[0])) == "The capital of France is Paris."  # the README's example
    assert got[0] == expected[0], tokenizer.decode(list(got[0]))
    assert answer_agreement(expected, got) >= DEFAULT_ANSWERS
    d = divergence(float_logits, export_logits(exported(DEFAULT), text_ids))
    print(f"int4 default: KL {d.kl_mean:.4f}, top-1 {d.top1:.1%}")
    assert d.kl_mean <= DEFAULT_KL and d.top1 >= DEFAULT_TOP1, d


@pytest.mark.xfail(strict=True, reason="issue 43's target, not met: the int4 default keeps 5 of 10 of "
                                       "float32's answers (every layout measured at least as fast as "
                                       "onnxruntime-genai's int4 kept at most 5; docs/quantisation.md#the-defaults)")
def test_the_int4_default_keeps_nine_of_ten_answers(default_answers):
    expected, got, _ = default_answers
    assert answer_agreement(expected, got) >= KEEPS_ANSWERS


def test_the_files_blocks_on_mixed_activations_keep_nine_of_ten_answers(text_ids, float_logits, exported,
                                                                         float_answers):
    """The layout that keeps issue 43's 9 of 10 (at 0.7x the peer's speed, so not the default):
    the GGUF file's own 4-bit blocks with float activations for the qkv and down products."""
    expected, got, tokenizer = _answers(MIXED, exported, float_answers)
    assert got[0] == expected[0], tokenizer.decode(list(got[0]))  # the README's example
    assert answer_agreement(expected, got) >= MIXED_ANSWERS
    d = divergence(float_logits, export_logits(exported(MIXED), text_ids))
    print(f"{MIXED}: KL {d.kl_mean:.4f}, top-1 {d.top1:.1%}")
    assert d.kl_mean <= MIXED_KL and d.top1 >= MIXED_TOP1, d
