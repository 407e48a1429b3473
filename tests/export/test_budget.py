"""The default int4 codes and ``--max-loss`` (export/calibrate.py ``resolve_calibration``,
export/budget.py) on tiny models that read the built-in text with a word-level tokenizer.

The budget's recorded losses are checked against an independent measurement: the exported
graph's perplexity through ONNX Runtime (portable target: float activations) against the float
module's on the same text, computed here with numpy.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from tests.export.text_models import perturbed, word_tokenizer
from tests.matrix import matrix_config
from tfport.manifest import Manifest
from tfport.export import ExportOptions, export_model
from tfport.export import hessians as activations
from tfport.export.budget import Candidate, pick
from tfport.export.calibrate import in_order, layer_of, recorded_scheme
from tfport.export.loss import LossBudget, parse_loss
from tfport.export.promotion import mix
from tfport.export.quant import QuantScheme, fake_quantize
from tfport.tools.parity.accuracy import export_logits, perplexity, reference_logits


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """(model, tokenizer.json path): d_model 64, so blocks of 32, 64 and 128 differ."""
    config = matrix_config("decoder", "rope", "gqa").replace(d_model=64, max_positions=256, tie_embeddings=True)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    word_tokenizer(config.vocab_size, path)
    return perturbed(config), path


def loss_ids(tokenizer_path, tokens: int = 256) -> np.ndarray:
    """The first ``tokens`` ids of the built-in text (what the budget measures on by default)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_path)).encode(activations.Calibration().read()).ids
    return np.array(ids[:tokens], dtype=np.int64)


# --------------------------------------------------------------------------- the default codes
def test_int4_defaults_to_gptq_with_a_tokenizer_and_says_so_without(decoder, tmp_path, caplog):
    model, tokenizer = decoder
    manifest = export_model(model, tmp_path / "auto", ExportOptions(quantize="int4", tokenizer=tokenizer))
    assert manifest.quantization["method"] == "gptq"
    assert manifest.quantization["calibration"]["text"] == "builtin"
    rtn = export_model(model, tmp_path / "none", ExportOptions(quantize="int4", tokenizer=tokenizer,
                                                               calibration="none"))
    assert "method" not in rtn.quantization
    with caplog.at_level(logging.WARNING, logger="tfport.export.calibrate"):
        bare = export_model(model, tmp_path / "bare", ExportOptions(quantize="int4"))
    assert "method" not in bare.quantization
    assert "without a tokenizer: round-to-nearest" in caplog.text
    int8 = export_model(model, tmp_path / "int8", ExportOptions(quantize="int8", tokenizer=tokenizer))
    assert "method" not in int8.quantization  # int8 stays round-to-nearest (within 0.1% on SmolLM2)


def test_zero_points_by_default_only_where_they_pay(decoder, tmp_path):
    """int4 of a decoder is symmetric unless asked (zero points cost decode speed); an encoder's
    int4 and any int8 keep them; ``symmetric`` given wins."""
    model, _ = decoder
    encoder = perturbed(matrix_config("encoder", "learned", "mha"))
    cases = {"dec-int4": (model, "int4", None, True), "dec-int8": (model, "int8", None, False),
             "enc-int4": (encoder, "int4", None, False), "dec-int4-zp": (model, "int4", False, False)}
    for name, (module, quantize, symmetric, expected) in cases.items():
        manifest = export_model(module, tmp_path / name, ExportOptions(quantize=quantize, symmetric=symmetric,
                                                                       calibration="none", validate=False))
        assert manifest.quantization["symmetric"] is expected, name


# --------------------------------------------------------------------------- --max-loss
def test_pick_takes_the_fastest_layout_within_the_budget():
    """The search order and the stop, on made-up speeds and losses."""
    layouts = [Candidate(128, None, per_s=90), Candidate(64, None, per_s=95), Candidate(32, None, per_s=80),
               Candidate(32, 8, per_s=70)]
    losses = {(128, None): 0.30, (64, None): 0.25, (32, None): 0.08, (32, 8): 0.05}
    measured = []

    def quantize(layout):
        measured.append(layout.block_size)
        layout.loss = losses[layout.block_size, layout.head_bits]
        return f"quantised {layout.name}"

    chosen, quantization = pick(layouts, quantize, 0.10, "int4")
    assert (chosen.block_size, chosen.head_bits, quantization) == (32, None, "quantised blocks of 32")
    assert measured == [64, 128, 32]  # fastest first, stopping at the first within the budget
    with pytest.raises(ValueError, match=r"max_loss=1\.000%: no int4 layout stays within it on this model; "
                                         r"measured: blocks of 128: 30\.000%; .*blocks of 32, head int8: 5\.000%"):
        pick(layouts, quantize, 0.01, "int4")


@pytest.mark.parametrize("hessians", ["kept", "per group"])
def test_max_loss_records_what_the_export_loses(decoder, tmp_path, monkeypatch, hessians):
    """Every candidate timed; with a budget every layout meets, the fastest is chosen, and its
    recorded loss is the exported graph's perplexity increase on the loss text. "per group":
    Hessians over the budget are collected again per layout, a group of layers at a time."""
    from tokenizers import Tokenizer

    from tfport.export import calibrate

    if hessians == "per group":
        monkeypatch.setattr(calibrate, "HESSIAN_BUDGET", 1)
    model, tokenizer = decoder
    loss_text = tmp_path / "loss.txt"
    loss_text.write_text(Tokenizer.from_file(str(tokenizer)).decode(loss_ids(tokenizer, 512).tolist()))
    manifest = export_model(model, tmp_path / "q", ExportOptions(
        quantize="int4", tokenizer=tokenizer, max_loss=1e9, loss_text=loss_text))
    quantization = manifest.quantization
    budget = quantization["budget"]
    candidates = budget["candidates"]
    assert budget["max_loss"] == 1e9 and budget["text"] == "loss.txt" and quantization["method"] == "gptq"
    assert {(c["block_size"], c["head_bits"]) for c in candidates} == {(b, h) for b in (128, 64, 32) for h in (None, 8)}
    assert all(c["per_s"] > 0 for c in candidates)
    fastest = max(candidates, key=lambda c: c["per_s"])
    assert (quantization["block_size"], quantization.get("head_bits")) == (fastest["block_size"], fastest["head_bits"])
    assert [c for c in candidates if c["loss"] is not None] == [fastest]
    ids = np.array(Tokenizer.from_file(str(tokenizer)).encode(loss_text.read_text()).ids, dtype=np.int64)
    windows = [ids[i:i + 256] for i in range(0, len(ids), 256)]  # the loss text read in max_positions windows

    def increase(logits_of) -> float:
        """Perplexity increase over the float module on the loss text, token-weighted over windows."""
        nll = [np.log(perplexity(logits_of(w), w)) * (len(w) - 1) for w in windows]
        reference = [np.log(perplexity(reference_logits(model, w), w)) * (len(w) - 1) for w in windows]
        return float(np.exp((sum(nll) - sum(reference)) / sum(len(w) - 1 for w in windows)) - 1)

    # the manifest's layout recomputed as tfport parity does it (the codes' sha256 checked), its
    # dequantised weights in the module: the loss the budget measured
    recomputed = fake_quantize(model, recorded_scheme(quantization, model, tokenizer, "float32"))
    assert increase(lambda w: reference_logits(recomputed, w)) == pytest.approx(budget["loss"], rel=1e-3)
    # the export as shipped adds ONNX Runtime's int8 activations (the budget's documented caveat)
    assert increase(lambda w: export_logits(tmp_path / "q", w)) == pytest.approx(budget["loss"], abs=0.02)


def test_max_loss_in_kl_records_every_metric(decoder, tmp_path):
    """A budget in KL divergence: every measured layout records the perplexity increase, the mean
    KL divergence and 1 - top-1 agreement, and the chosen layout's are those of the module with
    its recorded codes, computed here with torch's own KL (``F.kl_div``) on the loss text in the
    windows the budget reads."""
    from tokenizers import Tokenizer

    model, tokenizer = decoder
    loss_text = tmp_path / "loss.txt"
    loss_text.write_text(Tokenizer.from_file(str(tokenizer)).decode(loss_ids(tokenizer, 512).tolist()))
    manifest = export_model(model, tmp_path / "q", ExportOptions(
        quantize="int4", tokenizer=tokenizer, max_loss="kl=1e9", loss_text=loss_text, calibration="none",
        validate=False))
    quantization = manifest.quantization
    budget = quantization["budget"]
    assert budget["metric"] == "mean KL divergence" and budget["max_loss"] == 1e9
    chosen = next(c for c in budget["candidates"] if c["loss"] is not None)
    assert set(chosen) >= {"perplexity", "kl", "top1"} and chosen["loss"] == chosen["kl"]
    ids = np.array(Tokenizer.from_file(str(tokenizer)).encode(loss_text.read_text()).ids, dtype=np.int64)
    windows = [ids[i:i + 256] for i in range(0, len(ids), 256)]
    recomputed = fake_quantize(model, recorded_scheme(quantization, model, tokenizer, "float32"))
    kl, same, positions = 0.0, 0, 0
    with torch.no_grad():
        for w in windows:
            x = torch.from_numpy(w)[None]
            p = torch.log_softmax(model(x, torch.ones_like(x))[0][0, :-1].double(), -1)
            q = torch.log_softmax(recomputed(x, torch.ones_like(x))[0][0, :-1].double(), -1)
            kl += torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()
            same += int((p.argmax(-1) == q.argmax(-1)).sum())
            positions += len(w) - 1
    assert kl / positions == pytest.approx(chosen["kl"], rel=5e-3)  # float16 reference log-probabilities
    assert 1 - same / positions == pytest.approx(chosen["top1"], rel=1e-3)  # recorded to 4 digits
    assert chosen["kl"] > 0 and chosen["top1"] > 0  # int4 of this model moves something


def test_max_loss_for_an_encoder_measures_the_cosine(tmp_path):
    """1 - the minimum cosine of mean-pooled states; a budget nothing meets names every layout."""
    config = matrix_config("encoder", "learned", "mha").replace(d_model=64)
    model = perturbed(config)
    tokenizer = tmp_path / "tokenizer.json"
    word_tokenizer(config.vocab_size, tokenizer)
    manifest = export_model(model, tmp_path / "q", ExportOptions(
        quantize="int8", tokenizer=tokenizer, max_loss=1e9, calibration="none"))
    budget = manifest.quantization["budget"]
    assert budget["metric"] == "1 - minimum cosine" and "method" not in manifest.quantization
    assert {c["head_bits"] for c in budget["candidates"]} == {None}  # int8: no 8-bit head to add
    from tfport.runtime import load_model

    sentences = activations.token_sequences(activations.Calibration().read(), word_tokenizer(config.vocab_size),
                                            config, activations.DEFAULT_TOKENS)
    exported = load_model(tmp_path / "q")
    cosines = []
    for ids in sentences:
        x = torch.from_numpy(ids)[None]
        with torch.no_grad():
            expected = model(x, torch.ones_like(x)).last_hidden_state[0].double().mean(0).numpy()
        got = exported.encode(ids[None]).last_hidden_state[0].astype(np.float64).mean(0)
        cosines.append(expected @ got / np.linalg.norm(expected) / np.linalg.norm(got))
    assert 1 - min(cosines) == pytest.approx(budget["loss"], abs=5e-4)  # the export's int8 activations add a little
    with pytest.raises(ValueError, match=r"no int4 layout stays within it on this model; measured: "
                                         r"blocks of 128: .*; blocks of 64: .*; blocks of 32: .*"
                                         r"; with every layer int8: blocks of \d+[^:]*: \d"):  # speed order
        export_model(model, tmp_path / "n", ExportOptions(quantize="int4", tokenizer=tokenizer, max_loss=1e-12,
                                                          calibration="none"))
    assert not (tmp_path / "n").exists()


def test_refusals_name_the_option(decoder, tmp_path, capsys):
    from tfport.cli import main

    model, tokenizer = decoder
    for text in ("ten", "0", "inf", "-5%"):
        with pytest.raises(ValueError, match=f"max_loss={text!r}: expected"):
            parse_loss(text)
    assert parse_loss("10%") == LossBudget(pytest.approx(0.1)) and parse_loss("0.25") == LossBudget(0.25)
    assert parse_loss("kl=0.05") == LossBudget(0.05, "kl") and parse_loss("top1=5%") == LossBudget(0.05, "top1")
    assert parse_loss(" perplexity = 10% ") == LossBudget(pytest.approx(0.1), "perplexity")
    for text in ("kld=0.1", "kl=", "top1=-1%"):
        with pytest.raises(ValueError, match=f"max_loss={text!r}: expected"):
            parse_loss(text)
    with pytest.raises(ValueError, match="max_loss=kl=0.05: an encoder model's loss is one of cosine"):
        LossBudget(0.05, "kl").metric_for("encoder")
    with pytest.raises(ValueError, match="max_loss=cosine=0.05: an decoder model's loss is one of "
                                         "perplexity, kl, top1"):
        LossBudget(0.05, "cosine").metric_for("decoder")
    with pytest.raises(ValueError, match="max_loss=0.1: chooses the layout of quantize='int4' or 'int8', "
                                         "got no quantisation"):
        export_model(model, tmp_path / "a", ExportOptions(max_loss=0.1, tokenizer=tokenizer))
    with pytest.raises(ValueError, match="loss_text='missing.txt': no such file"):
        export_model(model, tmp_path / "b", ExportOptions(quantize="int4", max_loss=0.1, loss_text="missing.txt",
                                                          tokenizer=tokenizer))
    with pytest.raises(ValueError, match="loss_text=.*: applies with max_loss"):
        export_model(model, tmp_path / "c", ExportOptions(quantize="int4", loss_text=str(tokenizer)))
    with pytest.raises(ValueError, match="max_loss=0.1: measuring the loss reads a text, which needs"):
        export_model(model, tmp_path / "d", ExportOptions(quantize="int4", max_loss=0.1))
    assert main(["export", "tiny-decoder", "--out", str(tmp_path / "e"), "--quantize", "int4",
                 "--max-loss", "lots"]) == 2
    assert "max_loss='lots': expected a fraction or a percentage" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abcde")


def test_cli_reports_the_choice(decoder, tmp_path, capsys):
    from tfport.cli import main
    from tfport.models.checkpoint import save_checkpoint

    model, tokenizer = decoder
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(model, checkpoint)
    (checkpoint / "tokenizer.json").write_text(tokenizer.read_text())
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "q"), "--quantize", "int4",
                 "--max-loss", "3000%", "--head-bits", "8", "--calibration", "none"]) == 0
    out = capsys.readouterr().out
    assert "the fastest of 3 layouts within --max-loss 3000.0%" in out, out
    quantization = Manifest.read(tmp_path / "q").quantization
    assert quantization["head_bits"] == 8 and "method" not in quantization


def test_max_loss_quantises_with_the_calibration_threads_asked(decoder, tmp_path, monkeypatch):
    """``calibration_threads`` reaches the layout search's GPTQ, as it reaches a fixed layout's."""
    from tfport.export import budget

    seen = []
    original = budget.calibrate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("threads"))
        return original(*args, **kwargs)

    monkeypatch.setattr(budget, "calibrate", spy)
    model, tokenizer = decoder
    export_model(model, tmp_path / "q", ExportOptions(quantize="int4", tokenizer=tokenizer, max_loss=1e9,
                                                      calibration_threads=1, validate=False))
    assert seen == [1]  # one layout measured (every layout meets the budget), on one thread


def test_pick_promotes_a_faster_layout_when_that_is_faster_than_the_next():
    """A layout over the budget gets its sensitive layers promoted (``promote``: a timed mixed
    candidate); the fastest candidate within the budget wins, measured in speed order."""
    def run(mixed_speed):
        layouts = [Candidate(128, None, per_s=100), Candidate(64, None, per_s=90), Candidate(32, None, per_s=80)]
        losses = {128: 0.30, 64: 0.20, 32: 0.05}
        measured, promoted = [], []

        def quantize(layout):
            measured.append(layout.block_size)
            layout.loss = losses[layout.block_size]
            return f"codes {layout.block_size}"

        def promote(layout, codes):
            promoted.append(layout.block_size)
            if layout.block_size != 128:
                return None
            return Candidate(128, None, per_s=mixed_speed, loss=0.08, promoted=("decoder.layers.0",)), "mixed"

        chosen, codes = pick(layouts, quantize, 0.10, "int4", promote)
        return chosen, codes, measured, promoted

    chosen, codes, measured, promoted = run(95)  # faster than blocks of 64: nothing else measured
    assert (chosen.promoted, codes, measured, promoted) == (("decoder.layers.0",), "mixed", [128], [128])
    assert chosen.name == "blocks of 128, 1 layer int8"
    chosen, codes, measured, promoted = run(85)  # blocks of 64 might be faster: it is measured, fails
    assert (codes, measured, promoted) == ("mixed", [128, 64], [128, 64])
    chosen, codes, measured, promoted = run(75)  # blocks of 32 is within the budget and faster
    assert (chosen.block_size, chosen.promoted, codes, measured) == (32, (), "codes 32", [128, 64, 32])


@torch.no_grad()
def sampled(model, count: int) -> np.ndarray:
    """``count`` token ids sampled from ``model`` (seeded), from one start token: on its own
    samples a quantised copy loses the KL divergence from the float model in log-perplexity."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5]])
    while ids.shape[1] < count:
        logits, _ = model(ids, torch.ones_like(ids))
        probs = torch.softmax(logits[0, -1, 4:], dim=-1)  # no special ids: the text round-trips
        ids = torch.cat([ids, 4 + torch.multinomial(probs, 1, generator=generator)[None]], dim=1)
    return ids[0].numpy().astype(np.int64)


def test_promote_layers_finds_the_fewest_most_sensitive_layers():
    """Made-up losses: each layer promoted takes its gain off a base of 1.0; sensitivity is the
    loss with it alone, so the largest gains come first. Brute force over the ranking agrees."""
    from tfport.export.promotion import promote_layers

    gains = {"l0": 0.05, "l1": 0.4, "l2": 0.1, "l3": 0.3, "l4": 0.02}

    def loss_of(layers):
        return 1.0 - sum(gains[name] for name in layers)

    ranking = sorted(gains, key=lambda name: -gains[name])  # l1, l3, l2, l0, l4
    for budget in (0.65, 0.3, 0.2, 0.15):
        fewest = next(n for n in range(1, 6) if loss_of(tuple(ranking[:n])) <= budget)
        layers, loss = promote_layers(tuple(gains), loss_of, budget)
        assert set(layers) == set(ranking[:fewest]) and loss == pytest.approx(loss_of(tuple(ranking[:fewest])))
        assert list(layers) == sorted(layers, key=lambda name: int(name[1:]))  # model order
    assert promote_layers(tuple(gains), loss_of, 0.1) == (None, pytest.approx(1.0 - sum(gains.values())))
    layers, loss = promote_layers((), loss_of, 0.1)
    assert layers is None and np.isnan(loss)


def test_max_loss_promotes_the_sensitive_layers_of_a_layout_over_the_budget(decoder, tmp_path):
    """One layout (blocks of 32, head int4) over a budget that every layer at int8 meets: the
    fewest layers, most sensitive first, are promoted; the export's products of those layers
    are 8-bit, the recorded loss is the exported graph's (computed here from its logits), and
    tfport parity's recomputation gives the same codes."""
    import onnx
    from tokenizers import Tokenizer

    from tfport.export.calibrate import calibrate

    model, tokenizer = decoder
    model = copy.deepcopy(model)
    with torch.no_grad():  # softer logits (std ~2.7, not ~9): the quantised copies disagree with it
        model.get_parameter("decoder.norm.weight").mul_(0.3)
    scheme = QuantScheme(4, 32, True)
    base, high = calibrate(model, scheme, None, head_bits=4), calibrate(model, QuantScheme(8, 32, True), None, head_bits=4)
    layers = sorted({layer_of(n) for n, _ in model.named_parameters()} - {None})
    assert layers == [f"decoder.layers.{i}" for i in range(model.config.n_decoder_layers)]
    ids = sampled(model, 256)  # a text the float model finds likely: quantising it costs perplexity
    windows = [ids]

    def increase(logits_of) -> float:
        nll = [np.log(perplexity(logits_of(w), w)) * (len(w) - 1) for w in windows]
        reference = [np.log(perplexity(reference_logits(model, w), w)) * (len(w) - 1) for w in windows]
        return float(np.exp((sum(nll) - sum(reference)) / sum(len(w) - 1 for w in windows)) - 1)

    def module_loss(quantization) -> float:
        return increase(lambda w: reference_logits(fake_quantize(model, quantization), w))

    everything = module_loss(mix(base, high, tuple(layers)))
    none = module_loss(base)
    assert everything < none
    max_loss = (everything + none) / 2
    loss_text = tmp_path / "loss.txt"
    loss_text.write_text(Tokenizer.from_file(str(tokenizer)).decode(ids.tolist()))
    manifest = export_model(model, tmp_path / "q", ExportOptions(
        quantize="int4", tokenizer=tokenizer, max_loss=max_loss, loss_text=loss_text, calibration="none",
        block_size=32, head_bits=4, target="ort", validate=False))
    quantization = manifest.quantization
    promoted = quantization["promoted"]
    assert 0 < len(promoted) <= len(layers) and set(promoted) <= set(layers)
    budget_record = quantization["budget"]
    assert budget_record["loss"] <= max_loss
    assert [c["promoted"] for c in budget_record["candidates"] if "promoted" in c] == [promoted]
    # the recorded loss is the dequantised module's; its codes recomputed as tfport parity does
    recomputed = recorded_scheme(quantization, model, tokenizer, "float32")
    assert module_loss(recomputed) == pytest.approx(budget_record["loss"], rel=1e-3)
    # the fewest layers: the same layers but the last one, measured here, are over the budget
    order = sorted(layers, key=lambda layer: module_loss(mix(base, high, (layer,))))
    assert list(in_order(order[:len(promoted)])) == promoted
    assert module_loss(mix(base, high, tuple(order[:len(promoted) - 1]))) > max_loss
    # the graph: the promoted layers' products are 8-bit, the others 4-bit
    graph = onnx.load(str(tmp_path / "q" / "decoder.onnx"), load_external_data=False)
    bits = {node.name: next(a.i for a in node.attribute if a.name == "bits")
            for node in graph.graph.node if node.op_type == "MatMulNBits"}
    for name, value in bits.items():
        layer = layer_of(name + ".weight")
        assert value == (8 if layer in promoted else 4), (name, value)
    assert set(bits.values()) == {4, 8}  # here: one layer of two promoted
    with pytest.raises(ValueError, match="promoted='decoder.nope': not a layer of this model"):
        calibrate(model, scheme, None, promoted=("decoder.nope",))
    assert increase(lambda w: export_logits(tmp_path / "q", w)) == pytest.approx(budget_record["loss"], abs=0.02)


def test_mixed_codes_are_calibrates_with_those_layers_promoted(decoder):
    """``mix`` (GPTQ codes of two layouts assembled per layer) gives the codes ``calibrate``
    gives with ``promoted``, which ``tfport parity`` recomputes: the same sha256."""
    from tfport.export.calibrate import calibrate, fingerprint

    model, tokenizer = decoder
    sequences = [loss_ids(tokenizer, 256)]
    hessians = activations.collect_hessians(model, sequences)
    four, eight = QuantScheme(4, 32, True), QuantScheme(8, 32, True)
    base = calibrate(model, four, hessians, head_bits=8)
    high = calibrate(model, eight, hessians, head_bits=8)
    layers = ("decoder.layers.1",)
    direct = calibrate(model, four, sequences, head_bits=8, promoted=layers)
    assert fingerprint(mix(base, high, layers).index) == fingerprint(direct.index) != fingerprint(base.index)
    assert direct.record["promoted"] == list(layers)
    with pytest.raises(ValueError, match=r"layers=\['decoder.nope'\]: not layers with weight matrices"):
        mix(base, high, ("decoder.nope",))
