"""Calibrated quantisation (export/calibrate.py): GPTQ with the export's block layout.

Accuracy: a tiny decoder (perturbed random weights) is calibrated on the built-in text and
measured on held-out activations (tools/data/perplexity.txt, which calibration never reads):
every product's output error, the attention context, and the logits, against round-to-nearest.
Exactness: calibrated exports are validated by ``export_model`` against the fake-quantised module
(the same dequantised weights, float32 tolerances) and ``tfport parity`` recomputes the
calibration from the manifest. Real-weight accuracy (SmolLM2, MiniLM) is in docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tests.export.text_models import perturbed, word_tokenizer
from tests.matrix import matrix_config
from tfport.contract import MANIFEST_FILE
from tfport.export import ExportOptions, export_model
from tfport.export import calibrate as C
from tfport.export import gptq
from tfport.export import hessians as activations
from tfport.tools.parity.accuracy import PERPLEXITY_TEXT
from tfport.export.quant import QuantScheme, fake_quantize
from tfport.export import rounding
from tfport.export.blocks import BlockQuantized
from tfport.manifest import Manifest
from tfport.models import build_model

HELD_OUT = PERPLEXITY_TEXT


@pytest.fixture(scope="module")
def decoder():
    """(model, calibration sequences, held-out sequences): d_model 64 (so 2,048 calibration
    tokens are many more than any product's K), 256 positions."""
    torch.manual_seed(0)
    config = matrix_config("decoder", "rope", "gqa").replace(d_model=64, max_positions=256)
    tokenizer = word_tokenizer(config.vocab_size)
    fit = activations.token_sequences(activations.Calibration().read(), tokenizer, config, 2048)
    held = activations.token_sequences(HELD_OUT.read_text(), tokenizer, config, 512)
    return perturbed(config), fit, held


# ------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_reduces_every_products_error_on_held_out_activations(decoder, symmetric):
    """sum over held-out tokens |(W - Q) x|^2 per product (value rows with their attention-averaged
    inputs), GPTQ against round-to-nearest with the same blocks and scale search."""
    model, fit, held = decoder
    scheme = QuantScheme(4, 16, symmetric)
    calibrated, rtn = C.calibrate(model, scheme, fit), C.calibrate(model, scheme, None)
    ratios = {}
    for name, rows in activations.collect_hessians(model, held).items():
        w = model.get_parameter(name).detach().numpy()
        error = []
        for quantization in (calibrated, rtn):
            d = quantization.quantize(w).dequantize() - w
            error.append(sum(np.einsum("nk,kl,nl->", d[a:b], h.float().numpy(), d[a:b]) for a, b, h in rows))
        ratios[name] = error[0] / error[1]
    assert max(ratios.values()) < 0.6, ratios
    assert np.exp(np.mean(np.log(list(ratios.values())))) < 0.4, ratios
    x = torch.from_numpy(np.concatenate(held))[None]
    with torch.no_grad():
        reference = model(x)[0]
        mse = [float(((fake_quantize(model, q)(x)[0] - reference) ** 2).mean()) for q in (calibrated, rtn)]
    assert mse[0] < 0.6 * mse[1], mse


def test_value_rows_weighted_by_attention_beat_the_plain_hessian(decoder):
    """Only the value rows of each qkv quantised (GPTQ): with the attention-averaged inputs' Hessian
    the held-out attention context is closer to float than with the plain input Hessian."""
    model, fit, held = decoder
    hessians = activations.collect_hessians(model, fit)

    def contexts(module) -> list[torch.Tensor]:
        out = []
        hooks = [m.context.register_forward_hook(lambda _, args, o: out.append(o))
                 for n, m in module.named_modules() if n.endswith(".attn")]
        with torch.no_grad():
            for ids in held:
                activations._run(module, ids)
        for hook in hooks:
            hook.remove()
        return out

    reference = contexts(model)
    error = {}
    for label in ("attention", "plain"):
        quantized = copy.deepcopy(model)
        with torch.no_grad():
            for name, rows in hessians.items():
                if ".qkv." not in name:
                    continue
                weight = quantized.get_parameter(name)
                values = weight.detach().numpy().copy()
                assert len(rows) == 1 + model.config.kv_heads  # q and k rows, then one group per value head
                for start, end, hessian in rows[1:]:
                    h = hessian if label == "attention" else rows[0][2]
                    values[start:end] = gptq.gptq_rows(values[start:end], h, 4, 16, False).dequantize()
                weight.copy_(torch.from_numpy(values))
        error[label] = sum(float(((a - b) ** 2).sum()) for a, b in zip(contexts(quantized), reference))
    assert error["attention"] < 0.97 * error["plain"], error


def test_gptq_rows_keeps_the_layout_and_rounds_scales_first():
    """Same shapes as round-to-nearest (a short last block included); float16 scales are rounded
    before the codes are chosen, so dequantising reproduces the values GPTQ compensated for."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 40)).astype(np.float32)
    rows = rng.standard_normal((6, 40)).astype(np.float32)
    q = gptq.gptq_rows(rows, torch.from_numpy(x.T @ x / 256), 4, 16, False, "float16")
    assert q.codes.shape == (6, 40) and q.scales.shape == (6, 3) and q.scales.dtype == np.float16
    assert q.zero_points.shape == (6, 3) and int(q.codes.max()) <= 15
    with pytest.raises(ValueError, match=r"hessian: expected shape \(40, 40\)"):
        gptq.gptq_rows(rows, torch.eye(8), 4, 16, False)


def _textbook_gptq(rows: np.ndarray, hessian: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """Symmetric 4-bit GPTQ as the paper's Algorithm 1 writes it, in float64 with numpy: act-order,
    the given static block ``scales`` [N, Kb], every later column updated after each column (no
    lazy batches, no row chunks). The codes [N, K] (stored, 0..15)."""
    h = hessian.copy()
    k = len(h)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += gptq.DAMP * np.diag(h).mean()
    order = np.argsort(-np.diag(h), kind="stable")
    u = np.linalg.cholesky(np.linalg.inv(h[np.ix_(order, order)])).T  # H^-1 = U^T U, U upper
    w = rows[:, order].astype(np.float64)
    codes = np.zeros(rows.shape, np.int64)
    for i, column in enumerate(order):
        step = scales[:, column // block_size].astype(np.float64)
        q = np.clip(np.rint(w[:, i] / step), -8, 7)
        codes[:, column] = q + 8
        w[:, i + 1:] -= np.outer((w[:, i] - q * step) / u[i, i], u[i, i + 1:])
    return codes


def test_gptq_rows_agrees_with_the_textbook_algorithm(monkeypatch):
    """Lazy batches of columns and chunks of rows (several of each here) change only the order of
    the float32 work: the codes are those of the plain float64 algorithm (up to a rare rounding
    tie), and do not depend on the row chunk at all."""
    rng = np.random.default_rng(0)
    k = 80
    x = rng.standard_normal((400, k)) @ rng.standard_normal((k, k)) * 0.3 + rng.standard_normal(k)
    hessian = x.T @ x / 400
    hessian[5, :] = hessian[:, 5] = 0  # an input that is always 0
    rows = rng.standard_normal((24, k)).astype(np.float32)
    monkeypatch.setattr(gptq, "LAZY_COLUMNS", 32)  # 80 columns: batches of 32, 32 and 16
    whole = gptq.gptq_rows(rows, torch.from_numpy(hessian), 4, 16, True)
    monkeypatch.setattr(gptq, "CHUNK_ROWS", 7)  # 24 rows: chunks of 7, 7, 7 and 3
    chunked = gptq.gptq_rows(rows, torch.from_numpy(hessian), 4, 16, True)
    assert np.array_equal(chunked.codes, whole.codes) and np.array_equal(chunked.scales, whole.scales)
    reference = _textbook_gptq(rows, hessian, whole.scales, 16)
    assert np.mean(whole.codes == reference) >= 0.99 and np.abs(whole.codes - reference).max() <= 1
    nearest = rounding.nearest_codes(rows, np.repeat(whole.scales, 16, axis=1)[:, :k], None, 4)
    assert np.mean(whole.codes != nearest) > 0.05  # GPTQ moved codes off round-to-nearest's


@pytest.mark.parametrize("symmetric", [True, False])
def test_scale_search_does_not_depend_on_the_row_chunk(symmetric, monkeypatch):
    """The clipping search runs a chunk of rows at a time (for the cache): 37 rows in chunks of 5
    give the scales and codes of one chunk, with importance weights (GPTQ) and without (RTN)."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((37, 70)).astype(np.float32)
    blocks = np.pad(rows, ((0, 0), (0, 10))).reshape(37, 5, 16)
    importance = rng.random((5, 16)).astype(np.float32)

    def search():
        quantized = rounding.quantize_rows(rows, 4, 16, symmetric)
        return (quantized.codes, quantized.scales, quantized.zero_points,
                *rounding.search_scales(blocks, 4, symmetric, np.float16, rounding.SEARCH_FACTORS, importance))

    whole = search()
    monkeypatch.setattr(rounding, "SEARCH_CHUNK", 5)
    for a, b in zip(search(), whole):
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))


def test_head_bits_hold_when_a_head_row_also_occurs_in_a_layer():
    """A zero row in a layer's product and in the LM head (a padded vocabulary row): the head is
    still found whole, at head_bits, not re-quantised at the scheme's bits."""
    model = build_model(matrix_config("decoder", "rope", "gqa").replace(tie_embeddings=False), seed=0)
    with torch.no_grad():
        model.decoder.layers[0].attn.out.weight[3].zero_()
        model.lm_head.weight[0].zero_()
    quantization = C.calibrate(model, QuantScheme(4, 16), None, head_bits=8)
    head = quantization.quantize(model.lm_head.weight.detach().numpy())
    layer = quantization.quantize(model.decoder.layers[0].attn.out.weight.detach().numpy())
    assert (head.bits, layer.bits, quantization.requantized) == (8, 4, 0)
    held = {type(m).__name__ for m in quantization.index.matrices}  # 4-bit codes two per byte
    assert held == {"NibbleBlocks", "BlockQuantized"} and isinstance(layer, BlockQuantized)


def test_sentences_and_sequences():
    assert activations.sentences("One. Two? Three!\n\nA code line\nand more") == ["One.", "Two?", "Three!",
                                                                        "A code line and more"]
    config = matrix_config("decoder", "rope", "gqa")  # max_positions 64
    text = activations.Calibration().read()
    sequences = activations.token_sequences(text, word_tokenizer(config.vocab_size), config, 100)
    assert [len(s) for s in sequences] == [64, 36]


# ------------------------------------------------------------------------------- exports
@pytest.mark.parametrize("target", ["portable", "ort"])
def test_calibrated_export_is_exact_and_parity_recomputes_it(target, tmp_path):
    """export_model validates against the fake-quantised module; tfport parity recomputes the
    calibration from the manifest (and refuses a manifest whose codes it cannot reproduce)."""
    from tfport.cli import main
    from tfport.tools.parity.cli import reference_scheme
    from tfport.models.checkpoint import save_checkpoint

    config = matrix_config("decoder", "rope", "gqa").replace(d_model=64, tie_embeddings=True)
    model = perturbed(config)
    tokenizer = word_tokenizer(config.vocab_size, tmp_path / "tokenizer.json")
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(model, checkpoint)
    (checkpoint / "tokenizer.json").write_text(tokenizer.to_str())
    out = tmp_path / "q"
    assert main(["export", str(checkpoint), "--out", str(out), "--target", target, "--quantize", "int4",
                 "--block-size", "16", "--calibration", "builtin", "--calibration-tokens", "512",
                 "--head-bits", "8"]) == 0
    quantization = Manifest.read(out).quantization
    assert quantization["method"] == "gptq" and quantization["head_bits"] == 8
    assert quantization["calibration"]["text"] == "builtin" and quantization["calibration"]["tokens"] == 512
    assert main(["parity", str(out), "--against", str(checkpoint)]) == 0
    # the tied table (gather and head) is int8, every other product int4
    graph = onnx.load(str(out / "decoder.onnx"))
    if target == "ort":
        bits = {n.name: a.i for n in graph.graph.node for a in n.attribute if a.name == "bits"}
        assert {b for name, b in bits.items() if "lm_head" in name or "embed" in name} == {8}, bits
        assert {b for name, b in bits.items() if "lm_head" not in name and "embed" not in name} == {4}, bits
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["quantization"]["sha256"] = "0" * 64
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="other codes than the export's"):
        reference_scheme(manifest["quantization"], str(checkpoint), model, tmp_path / "tokenizer.json")


@pytest.mark.parametrize("family,position", [("encoder", "learned"), ("encoder-decoder", "relative")])
def test_other_families_export_exactly(family, position, tmp_path):
    """Encoders read the text sentence by sentence; encoder-decoders calibrate both stacks and the
    cross-attention (its value rows weighted by the cross-attention probabilities)."""
    config = matrix_config(family, position, "mha")
    model = perturbed(config)
    word_tokenizer(config.vocab_size, tmp_path / "tokenizer.json")
    manifest = export_model(model, tmp_path / "q", ExportOptions(quantize="int4", block_size=16,
                                                                 calibration=activations.Calibration("builtin", 512),
                                                                 tokenizer=tmp_path / "tokenizer.json"))
    assert manifest.quantization["method"] == "gptq" and manifest.quantization["calibration"]["tokens"] == 512


# ------------------------------------------------------------------------------- refusals
def test_refusals_name_the_option(tmp_path):
    model = perturbed(matrix_config("decoder", "rope", "gqa"))
    tokenizer = tmp_path / "tokenizer.json"
    word_tokenizer(model.config.vocab_size, tokenizer)
    with pytest.raises(ValueError, match="calibration='builtin': applies to quantize='int4' or 'int8'"):
        export_model(model, tmp_path / "a", ExportOptions(calibration="builtin", tokenizer=tokenizer))
    with pytest.raises(ValueError, match="calibration='builtin': reading the text needs the model's tokenizer"):
        export_model(model, tmp_path / "b", ExportOptions(quantize="int4", calibration="builtin"))
    with pytest.raises(ValueError, match="calibration='missing.txt': expected 'builtin' or the path of a text file"):
        export_model(model, tmp_path / "c", ExportOptions(quantize="int4", calibration="missing.txt",
                                                          tokenizer=tokenizer))
    with pytest.raises(ValueError, match="calibration_tokens=8: expected an integer >= 16"):
        activations.Calibration(tokens=8)
    with pytest.raises(ValueError, match="head_bits=3: expected None or one of"):
        export_model(model, tmp_path / "d", ExportOptions(quantize="int4", head_bits=3))
    with pytest.raises(ValueError, match="head_bits=8: this model has no LM head or token table quantised"):
        export_model(perturbed(matrix_config("decoder", "rope", "gqa").replace(tie_embeddings=True)), tmp_path / "e",
                     ExportOptions(quantize=QuantScheme(4, 32, embeddings=False), head_bits=8))
    assert not any((tmp_path / n).exists() for n in "abcde")  # refused before anything was written


def test_cli_refusals(tmp_path, capsys):
    from tfport.cli import main

    out = str(tmp_path / "q")
    assert main(["export", "tiny-decoder", "--out", out, "--quantize", "int4", "--calibration-tokens", "64"]) == 2
    assert "--calibration-tokens=64: applies with --calibration" in capsys.readouterr().err
    assert main(["export", "tiny-decoder", "--out", out, "--quantize", "int4", "--calibration", "builtin"]) == 2
    assert "needs the model's tokenizer" in capsys.readouterr().err
    assert main(["export", "tiny-decoder", "--out", out, "--calibration", "builtin"]) == 2
    assert "applies to quantize='int4' or 'int8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "tiny-decoder", "--out", out, "--quantize", "int4", "--head-bits", "3"])
    assert not Path(out).exists()


def test_calibrating_in_groups_of_layers_gives_the_same_codes(decoder, monkeypatch):
    """A Hessian budget smaller than one layer's: one pass per group, the same codes as one pass
    (every pass runs the unquantised module), each group's Hessians within the budget."""
    model, fit, _ = decoder
    names = [f"{path}.weight" for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    budget = max(activations.hessian_bytes(model, name) for name in names)
    groups = C.hessian_groups(model, names, budget)
    assert len(groups) > 2 and [n for g in groups for n in g] == names
    assert all(sum(activations.hessian_bytes(model, n) for n in g) <= budget for g in groups)
    whole = C.fingerprint(C.calibrate(model, QuantScheme(4, 16), fit).index)
    monkeypatch.setattr(C, "HESSIAN_BUDGET", budget)
    passes = []
    monkeypatch.setattr(C, "collect_hessians", lambda *a, **k: passes.append(1) or activations.collect_hessians(*a, **k))
    assert C.fingerprint(C.calibrate(model, QuantScheme(4, 16), fit).index) == whole
    assert len(passes) == len(groups)


def test_threads_give_the_codes_of_one_thread(decoder, monkeypatch):
    """Matrices quantised on several threads at once (each with one torch thread), or one at a
    time when the working-memory budget admits only one: the codes of one thread, in order."""
    model, fit, _ = decoder
    hessians = activations.collect_hessians(model, fit)
    one = C.fingerprint(C.calibrate(model, QuantScheme(4, 16), hessians, threads=1).index)
    assert C.fingerprint(C.calibrate(model, QuantScheme(4, 16), hessians, threads=4).index) == one
    monkeypatch.setattr(C, "WORK_BUDGET", 1)
    assert C.fingerprint(C.calibrate(model, QuantScheme(4, 16), hessians, threads=4).index) == one
    with pytest.raises(ValueError, match=r"calibration_threads=0: expected a positive integer"):
        C.calibrate(model, QuantScheme(4, 16), hessians, threads=0)


def test_jobs_run_at_once_within_the_memory_budget():
    """Two jobs of 1 byte under a budget of 2 run together (each waits for the other at a
    barrier, which breaks after 10 s if they do not); a third waits for a free byte. Results come
    in the jobs' order and every job is counted done once; a job's error is raised."""
    barrier, lock = threading.Barrier(2, timeout=10), threading.Lock()
    running, most, done = [0], [0], []

    def job(value: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if value < 2:
            barrier.wait()  # the first two: together
        with lock:
            running[0] -= 1
        return value * 10

    with ThreadPoolExecutor(3) as pool:
        results = C._run_bounded(pool, [(1, job, (value,)) for value in range(5)], lambda: done.append(1), budget=2)
    assert results == [0, 10, 20, 30, 40] and len(done) == 5 and most[0] == 2
    with ThreadPoolExecutor(2) as pool, pytest.raises(ZeroDivisionError):
        C._run_bounded(pool, [(1, lambda: 1, ()), (1, lambda: 1 / 0, ())], lambda: None)



def test_a_finished_job_frees_its_arguments():
    """A matrix's Hessians go with its job: when a job starts, the jobs finished before it no
    longer hold their arguments (one worker: each job starts after the last one was let go)."""
    import weakref

    class Hessians:  # stands for a matrix's Hessians
        pass

    arguments = [Hessians() for _ in range(4)]
    refs = [weakref.ref(a) for a in arguments]
    seen = []

    def job(index, hessians):
        seen.append([ref() is None for ref in refs[:index]])
        return index

    jobs = [(1, job, (i, arguments[i])) for i in range(4)]
    del arguments
    with ThreadPoolExecutor(1) as pool:
        assert C._run_bounded(pool, jobs, lambda: None) == [0, 1, 2, 3]
    assert seen == [[], [True], [True, True], [True, True, True]] and jobs == []


HESSIAN_MODELS = {  # family, position, attention; a mixture of experts on top of the decoder
    "decoder": ("decoder", "rope", "gqa", None),
    "mixture": ("decoder", "rope", "gqa", dict(n_experts=4, top_k=2, d_expert=32, layers=(1,))),
    "encoder-decoder": ("encoder-decoder", "relative", "mha", None),
    "encoder": ("encoder", "learned", "mha", None),
}


@pytest.mark.parametrize("kind", list(HESSIAN_MODELS))
def test_hessians_are_the_mean_input_products(kind):
    """collect_hessians against a plain reference: each product's inputs caught by ordinary forward
    hooks over the same batches, H = mean of x x^T in float64. Passes stop after the last hook
    (the LM head's product runs only in the two-token probe), and products that read one input
    (gate and up, a mixture's router and experts) share one H."""
    from tfport.config.moe import MoeConfig

    family, position, attention, moe = HESSIAN_MODELS[kind]
    config = matrix_config(family, position, attention)
    if moe:
        config = config.replace(gated_ffn=True, activation="silu", moe=MoeConfig(**moe))
    model = perturbed(config)
    sequences = activations.token_sequences(activations.Calibration().read(), word_tokenizer(config.vocab_size),
                                            config, 96)
    linear = {f"{path}.weight": m for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    sums: dict[str, tuple[torch.Tensor, int]] = {}

    def catch(name: str):
        def hook(module, args, output):
            x = args[0].double().flatten(0, -2)  # [n, K]
            total, count = sums.get(name, (0.0, 0))
            sums[name] = (total + x.T @ x, count + len(x))
        return hook

    hooks = [m.register_forward_hook(catch(name)) for name, m in linear.items()]
    with torch.no_grad():
        for ids in activations.batches(sequences):
            activations._run(model, ids)
    reference = {name: total / count for name, (total, count) in sums.items()}
    head_calls = sums.get("lm_head.weight", (0.0, 0))[1]
    hessians = activations.collect_hessians(model, sequences)
    for hook in hooks:
        hook.remove()
    assert set(hessians) == set(linear)
    for name, rows in hessians.items():
        h = rows[0][2]
        assert torch.allclose(h, reference[name], rtol=1e-4, atol=1e-6 * float(reference[name].abs().max())), name
    if "lm_head.weight" in linear:  # the reference's tokens, then only the probe's 2 more
        assert sums["lm_head.weight"][1] == head_calls + 2
    if moe:
        layer = "decoder.layers.1.ffn"
        shared = {hessians[f"{layer}.{p}.weight"][0][2] is hessians[f"{layer}.router.weight"][0][2]
                  for p in ("experts.0.gate", "experts.0.up", "experts.3.up")}
        assert shared == {True}
