"""``tfport bench --rows``: every candidate graph (``products``) computes x @ W^T for the weights
its initializers hold, read back here by the operators' documented layouts (not by tfport's
packing code), and those weights are W within its quantisation error; then one quick run of each
measurement (``rows``) and the shape of its JSON (never a speed)."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tfport.cli import main
from tfport.tools.bench import rows
from tfport.tools.bench.products import (CANDIDATES, MIN_SAMPLES, ORT_ERRORS, SESSIONS, bound_call, get_candidate,
                                           open_session)

MIB = 2**20
K, N = 80, 48  # K = 2.5 blocks of 32: a short last block, padded in MatMulNBits' B

# candidate -> (weights: ||W_graph - W|| / ||W||, product: max |y - ref| / max |ref|), where
# W_graph is what the graph's initializers decode to and ref = x @ W_graph^T in float64.
TOLERANCES = {
    "f32": (0.0, 1e-5),  # the weights themselves; float32 sums of 80 terms
    "f16": (1e-3, 5e-3),  # float16 rounding of weights (2^-11), activations and sums
    "nbits4-l0": (0.12, 1e-5),  # 4-bit codes, 16 levels over a block's range; float activations
    "nbits4-l1": (0.12, 1e-5),  # level 1: float32 activations
    "nbits4-l2": (0.12, 5e-3),  # level 2: float16 activations where the CPU has them (else float32)
    "nbits4-l4": (0.12, 2e-2),  # level 4: activations rounded to int8 per block of 32 (127 levels)
    "nbits8-l4": (0.01, 2e-2),  # 8-bit codes, 256 levels; int8 activations per block as above
    "int8-dql-mitf": (0.03, 3e-2),  # 7-bit codes per column; uint8 activations, one scale per call
    "int8-dqmm": (0.03, 3e-2),  # the same computation in one operator
    "int8-rows": (0.03, 3e-2),  # 7-bit codes per column; uint8 activations, one scale per row
}
OPTIONAL = {"f16": "ONNX Runtime's CPU provider may lack a float16 MatMul kernel on this CPU"}


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., M] -> [..., 2M]: the low nibble first (MatMulNBits' documented order)."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def graph_weight(model: onnx.ModelProto) -> np.ndarray:
    """The float64 W [N, K] a candidate's one product computes with, from its initializers."""
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    integer = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    if integer:  # w8a8: B int8 [K, N]; the column scale (w_scale / 127) multiplies the int32 sums
        codes = init[integer[0].input[1]].astype(np.float64)
        column = next(n for n in model.graph.node if n.name.endswith(".channel_scale"))
        return (codes * init[column.input[1]].astype(np.float64) * 127).T
    node = next(n for n in model.graph.node if n.op_type != "DynamicQuantizeLinear")
    if node.op_type == "MatMul":  # B [K, N]
        return init[node.input[1]].astype(np.float64).T
    if node.op_type == "MatMulNBits":
        # B uint8 [N, Kb, block * bits / 8]; scales [N * Kb]; zero points [N * ceil(Kb * bits / 8)]
        a = _attributes(node)
        bits, block, k, n = a["bits"], a["block_size"], a["K"], a["N"]
        kb = -(-k // block)
        raw = init[node.input[1]].reshape(n, -1)
        codes = (_nibbles(raw) if bits == 4 else raw).astype(np.float64)  # [N, Kb * block]
        zero = init[node.input[3]].reshape(n, -1)
        zero = (_nibbles(zero) if bits == 4 else zero)[:, :kb].astype(np.float64)  # [N, Kb]
        scales = init[node.input[2]].reshape(n, kb).astype(np.float64)
        w = (codes - np.repeat(zero, block, axis=1)) * np.repeat(scales, block, axis=1)
        return w[:, :k]
    if node.op_type in ("MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
        # B int8 [K, N] with zero point 0 (none given) and b_scale [N] per column
        codes = init["B"].astype(np.float64)
        assert node.op_type == "DynamicQuantizeMatMul" or len(node.input) == 5, "no b_zero_point"
        return (codes * init["b_scale"].astype(np.float64)).T
    raise AssertionError(f"no reference for {node.op_type}")


def relative(error: np.ndarray, scale: np.ndarray) -> float:
    return float(np.abs(error).max() / np.abs(scale).max())


@pytest.mark.parametrize("candidate", CANDIDATES, ids=lambda c: c.name)
def test_candidate_computes_the_product_of_its_weights(candidate):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((N, K)).astype(np.float32)  # [N, K]
    x = rng.standard_normal((5, K)).astype(np.float32)  # [M, K]
    weight_tol, product_tol = TOLERANCES[candidate.name]
    product = candidate.build(weight)
    decoded = graph_weight(product.model)
    assert decoded.shape == (N, K)
    assert np.linalg.norm(decoded - weight) <= weight_tol * np.linalg.norm(weight)
    xin = x.astype(product.dtype)
    reference = np.einsum("mk,nk->mn", xin.astype(np.float64), decoded)  # [M, N]
    for kind in SESSIONS:
        try:
            session = open_session(product, threads=1, session=kind)
        except ORT_ERRORS as err:
            if candidate.name in OPTIONAL:
                pytest.skip(f"{OPTIONAL[candidate.name]}: {err}")
            raise
        for m in (1, 5):  # one row (decode) and several
            y = session.run(None, {"x": xin[:m]})[0]
            assert y.shape == (m, N) and y.dtype == product.dtype
            assert relative(y.astype(np.float64) - reference[:m], reference[:m]) <= product_tol, \
                (candidate.name, kind, m)
            bound = np.full((m, N), np.nan, product.dtype)  # the timed path writes here
            bound_call(session, xin[:m], bound)()
            np.testing.assert_array_equal(bound, y)


def test_stored_bytes_follow_the_documented_layouts():
    """Bytes the operators read, counted from the layouts for K = 80 (Kb = 3 blocks of 32)."""
    weight = np.ones((N, K), np.float32)
    kb = 3
    expected = {"f32": 4 * K * N, "f16": 2 * K * N,
                "nbits4": N * kb * 16 + 4 * N * kb + N * 2,  # codes, scales, zero points 2 per byte
                "nbits8": N * kb * 32 + 4 * N * kb + N * kb,
                "int8": K * N + 4 * N}  # int8 codes, one float32 scale per column
    for candidate in CANDIDATES:
        family = candidate.name.split("-")[0]
        assert candidate.build(weight).stored_bytes == expected[family], candidate.name


def test_settings_name_the_bad_value():
    with pytest.raises(ValueError, match="session='mine'"):
        open_session(get_candidate("f32").build(np.ones((N, K), np.float32)), 1, "mine")
    with pytest.raises(ValueError, match=r"rows=\(0,\)"):
        rows.RowsSettings(rows=(0,))
    with pytest.raises(ValueError, match="candidate='nbits3'"):
        rows.RowsSettings(candidates=("nbits3",))


# ----------------------------------------------------------------------------- quick runs
@pytest.fixture(scope="module")
def products_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.json"
    assert main(["bench", "--rows", "--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_quick_products_cover_every_cell(products_json):
    settings, products = products_json["settings"], products_json["products"]
    assert products_json["format"] == rows.JSON_FORMAT and "exports" not in products_json
    assert settings["rows"] == list(rows.QUICK_ROWS.rows) and settings["repeats"] == rows.QUICK_ROWS.repeats
    names = [c.name for c in CANDIDATES]
    assert [c["name"] for c in products["candidates"]] == names
    shapes = [s["name"] for s in products["shapes"]]
    assert [(e["shape"], e["candidate"]) for e in products["memory"]] == [(s, c) for s in shapes for c in names]
    measured = [(e["shape"], e["candidate"]) for e in products["memory"] if "skipped" not in e]
    assert {name for _, name in measured} >= set(names) - set(OPTIONAL)
    cells = {(c["shape"], c["candidate"], c["session"], c["rows"]) for c in products["cells"]}
    assert cells == {(s, c, kind, m) for s, c in measured for kind in SESSIONS for m in settings["rows"]}
    for cell in products["cells"]:
        assert min(MIN_SAMPLES, settings["repeats"]) <= len(cell["us_samples"]) <= settings["repeats"]
        assert min(cell["us_samples"]) > 0
        assert cell["us"] == pytest.approx(float(np.median(cell["us_samples"])))
    for entry in products["memory"]:
        assert entry["stored_bytes"] > 0
        if "skipped" not in entry:
            assert all(isinstance(entry[f"{kind}_session_mib"], float) for kind in SESSIONS)


def test_quick_step_totals_and_picks_follow_the_cells(products_json):
    products = products_json["products"]
    count = {s["name"]: s["count"] for s in products["shapes"]}
    stored = {(e["shape"], e["candidate"]): e["stored_bytes"] for e in products["memory"]}
    for total in products["step"]:
        group = [c for c in products["cells"] if (c["candidate"], c["session"], c["rows"])
                 == (total["candidate"], total["session"], total["rows"])]
        assert len(group) == len(count)
        assert total["us"] == pytest.approx(sum(count[c["shape"]] * c["us"] for c in group))
        assert total["weight_bytes"] == sum(count[s] * stored[s, total["candidate"]] for s in count)
    for pick in products["fastest"]:
        at_m = [t for t in products["step"] if t["rows"] == pick["rows"]]
        assert pick["step"]["us"] == min(t["us"] for t in at_m)
        for shape, best in pick["per_shape"].items():
            assert best["us"] == min(c["us"] for c in products["cells"]
                                     if c["shape"] == shape and c["rows"] == pick["rows"])
    assert set(products["overhead_us"]) == {str(m) for m in products_json["settings"]["rows"]}


def test_quick_exports_time_each_export_by_rows(tmp_path):
    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.presets import get_preset

    module = build_model(get_preset("tiny-decoder"), seed=0)
    exports = {"float32": tmp_path / "f32", "int4": tmp_path / "int4"}
    export_model(module, exports["float32"], ExportOptions())
    export_model(module, exports["int4"], ExportOptions(quantize="int4"))
    path = tmp_path / "exports.json"
    assert main(["bench", "--rows-exports", ",".join(str(p) for p in exports.values()), "--quick",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert "products" not in result
    settings = result["settings"]
    got = {(r["export"], r["rows"]): r for r in result["exports"]}
    assert set(got) == {(str(d), m) for d in exports.values() for m in settings["export_rows"]}
    for quantization, directory in exports.items():
        files = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
        for m in settings["export_rows"]:
            row = got[str(directory), m]
            assert row["quantization"] == quantization
            assert row["files_mib"] == pytest.approx(files / MIB)
            assert len(row["step_ms_repeats"]) == settings["repeats"]
            assert row["step_ms"] > 0 and math.isclose(row["tokens_per_s"], m * 1e3 / row["step_ms"])
