"""Quantised SmolLM2-135M-Instruct against its own float32 weights: the issue's accuracy targets
on real weights, measured through the export as shipped (the ``ort`` target, MatMulNBits at
accuracy level 4: int8 activations; w8a8's MatMulInteger on activations rounded per row) and the
torch-free runtime.

Perplexity is read on the fixed text ``tfport parity --accuracy`` uses
(``export/data/perplexity.txt``, 1,844 SmolLM2 tokens, which calibration never reads), against the
float32 PyTorch module's perplexity on the same ids. The bounds are the targets, not the measured
values (docs/quantisation.md#the-defaults, docs/benchmarks.md): the int4 default (blocks of 128,
measured +13.5%) within 20%, well under onnxruntime-genai's default int4 (+29.9%, issue 28's
bound); int4 with the head at int8 (+9.4%) and w8a8 (+5.3%) within 10%; int8 (+0.1%) within 3%.
A regression in the quantiser, the calibration or a lowering moves them past the bound. The
exactness of each graph against its own dequantised weights is tested on tiny models
(tests/export/test_quantize.py, test_calibrate.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tfport.export import ExportOptions, export_model
from tfport.export.parity.accuracy import PERPLEXITY_TEXT, export_logits, perplexity, reference_logits

# (quantize, calibration, head_bits, bound on perplexity / float32 perplexity)
SCHEMES = {
    "int8 round-to-nearest": ("int8", "none", None, 1.03),
    "int4 default (GPTQ, blocks of 128)": ("int4", "auto", None, 1.20),  # what --quantize int4 alone gives
    "int4 --head-bits 8": ("int4", "auto", 8, 1.10),
    "w8a8 (int8 activations per row)": ("w8a8", "none", None, 1.10),  # measured +5.3%; one scale per step: +71%
}


@pytest.fixture(scope="module")
def text_ids(smollm2):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smollm2.tokenizer)).encode(PERPLEXITY_TEXT.read_text()).ids
    return np.array(ids, dtype=np.int64)


@pytest.fixture(scope="module")
def float_perplexity(smollm2, text_ids):
    return perplexity(reference_logits(smollm2.model, text_ids), text_ids)


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


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantised_perplexity_meets_the_target(name, smollm2, text_ids, float_perplexity, hessians_once, tmp_path):
    quantize, calibration, head_bits, bound = SCHEMES[name]
    out = tmp_path / "export"
    export_model(smollm2.model, out, ExportOptions(target="ort", quantize=quantize, head_bits=head_bits,
                                                   calibration=calibration, tokenizer=smollm2.tokenizer,
                                                   validate=False))
    quantized = perplexity(export_logits(out, text_ids), text_ids)
    ratio = quantized / float_perplexity
    print(f"{name}: perplexity {quantized:.3f} vs float32 {float_perplexity:.3f} ({ratio:.3f}x)")
    assert np.isfinite(quantized)
    assert 1.0 / bound < ratio <= bound, f"{name}: perplexity {quantized:.3f} is {ratio:.3f}x float32's"
