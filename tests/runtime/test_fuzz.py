"""Property-based fuzzing of the public runtime API and the CLI.

Each argument is drawn either from values the API must accept or from values it must refuse,
and the draw records which. The only allowed outcomes are a correct result (every argument
valid) or a ``ValueError``/``TypeError`` whose message names one of the refused arguments;
anything else -- another exception, a wrong result, an invalid argument accepted -- fails.
Random command lines may only exit 0, or 2 with an ``error:`` line (argparse's usage errors
included); valid ones must exit 0 with one output line per prompt.

Examples are bounded and derandomized so the suite stays fast and stable (about 25 s on 2 cores,
the shared exports included). To explore further with fresh random draws:

    TFPORT_FUZZ_EXAMPLES=2000 pytest tests/runtime/test_fuzz.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="fuzz tests need 'hypothesis' (extra 'dev')")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tfport.cli import main  # noqa: E402
from tfport.runtime import load_model  # noqa: E402
from tfport.runtime.encoding import POOLINGS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
EXPLORE = int(os.environ.get("TFPORT_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` derandomized draws, or TFPORT_FUZZ_EXAMPLES random ones."""
    return settings(max_examples=EXPLORE or examples, derandomize=not EXPLORE, deadline=None,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


V = 96  # vocab_size of every tiny preset
MAX_POSITIONS = 64
DEC, S2S, ENC, ENC_TEXT, DEC_TEXT = "decoder-rope", "encoder-decoder", "encoder", "encoder-text", "decoder-text"


# ------------------------------------------------------------------------------------ strategies
INVALID_ONE_IN = 8  # each argument is invalid in 1 of 8 draws: most calls are valid, some not


@st.composite
def arg(draw, valid: st.SearchStrategy, invalid: st.SearchStrategy, *names: str):
    """(value, None) from ``valid``, or, once in INVALID_ONE_IN draws, (value, the names an
    error may name) from ``invalid`` (shrinking goes towards valid values)."""
    if draw(st.integers(0, INVALID_ONE_IN - 1)) == INVALID_ONE_IN - 1:
        return draw(invalid), set(names)
    return draw(valid), None


junk = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.binary(max_size=4),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                 st.complex_numbers(allow_nan=False, max_magnitude=4), st.just(object()))
token = st.integers(0, V - 1)
bad_token = st.one_of(st.integers(max_value=-1), st.integers(min_value=V), st.just(2**70))
rows = st.lists(st.lists(token, min_size=1, max_size=8), min_size=1, max_size=3)
int_dtypes = st.sampled_from([np.int64, np.int32, np.int16, np.uint8])


@st.composite
def arrays(draw, low=0, high=V - 1):
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    values = draw(st.lists(st.integers(low, high), min_size=b * s, max_size=b * s))
    return np.array(values, dtype=draw(int_dtypes)).reshape(b, s)


@st.composite
def valid_prompts(draw):
    """(input_ids, attention_mask) the runtime must accept."""
    kind = draw(st.sampled_from(["lists", "array", "masked", "matrix", "tuples"]))
    if kind == "lists":
        return draw(rows), None
    if kind == "tuples":
        return tuple(tuple(r) for r in draw(rows)), None
    ids = draw(arrays())
    if kind == "matrix":
        return np.matrix(ids), None
    if kind == "array":
        return ids, None
    mask = np.array(draw(st.lists(st.integers(0, 1), min_size=ids.size, max_size=ids.size)),
                    dtype=np.int64).reshape(ids.shape)
    mask[:, draw(st.integers(0, ids.shape[1] - 1))] = 1  # every row keeps a token
    return ids, mask


@st.composite
def invalid_prompts(draw):
    """(input_ids, attention_mask, names the error may name) the runtime must refuse."""
    ids = draw(arrays())
    cases = {
        "empty batch": ([], None, {"input_ids"}),
        "empty prompt": (draw(rows) + [[]], None, {"input_ids"}),
        "token out of range": ([draw(st.lists(token, max_size=4)) + [draw(bad_token)]], None,
                               {"input_ids"}),
        "flat list": (draw(st.lists(token, min_size=1, max_size=4)), None, {"input_ids"}),
        "junk": (draw(junk), None, {"input_ids"}),
        "junk rows": ([draw(junk)], None, {"input_ids"}),
        "float array": (ids.astype(np.float32), None, {"input_ids"}),
        "float lists": ([[1.0, 2.5]], None, {"input_ids"}),
        "bool array": (ids > 3, None, {"input_ids"}),
        "rank 1": (ids[0], None, {"input_ids"}),
        "rank 3": (ids[None], None, {"input_ids"}),
        "too long": ([[1] * (MAX_POSITIONS + 1)], None, {"input_ids"}),
        "masked array": (np.ma.masked_array(ids, mask=ids > 50), None, {"input_ids"}),
        "mask shape": (ids, np.ones((ids.shape[0], ids.shape[1] + 1), np.int64), {"attention_mask"}),
        "mask values": (ids, np.full(ids.shape, 2), {"attention_mask"}),
        "mask float": (ids, np.ones(ids.shape, np.float32), {"attention_mask"}),
        "mask junk": (ids, draw(junk.filter(lambda v: v is not None)), {"attention_mask"}),
        "mask with lists": (ids.tolist(), np.ones(ids.shape, np.int64), {"attention_mask"}),
        "padding row": (ids, np.zeros(ids.shape, np.int64), {"input_ids", "attention_mask"}),
    }
    return cases[draw(st.sampled_from(sorted(cases)))]


@st.composite
def prompt_args(draw):
    """(input_ids, attention_mask, None) or, once in INVALID_ONE_IN, an invalid prompt."""
    if draw(st.integers(0, INVALID_ONE_IN - 1)) == INVALID_ONE_IN - 1:
        return draw(invalid_prompts())
    return (*draw(valid_prompts()), None)


prompts = prompt_args()
bad_number = st.sampled_from([True, "0.5", [1.0], 1 + 2j, float("nan"), float("inf"),
                              -float("inf"), 10**400, np.longdouble("1e4000")])
positive_steps = st.one_of(st.integers(1, 4), st.integers(1, 4).map(np.int64))
max_new_tokens = arg(positive_steps,
                     st.one_of(st.integers(max_value=0), st.just(2.0), st.just("3"),
                               st.just(True), st.integers(min_value=MAX_POSITIONS + 1)),
                     "max_new_tokens")
# None: the export's generation_config.json default (greedy without one)
temperature = arg(st.one_of(st.none(), st.just(0), st.floats(0, 4), st.sampled_from([1e-40, 5e-324, 1e-300]),
                            st.floats(0.1, 2).map(np.float32), st.just(np.float16(0.5))),
                  st.one_of(st.floats(max_value=-1e-300), bad_number), "temperature")
top_k = arg(st.one_of(st.none(), st.integers(0, 200), st.integers(0, 5).map(np.int64)),
            st.one_of(st.integers(max_value=-1), st.just(1.5), st.just("3"), st.just(True)), "top_k")
top_p = arg(st.one_of(st.none(), st.floats(0, 1, exclude_min=True)),
            st.one_of(st.floats(max_value=0), st.floats(min_value=1, exclude_min=True), bad_number),
            "top_p")
seed = arg(st.one_of(st.none(), st.integers(0, 2**100), st.builds(np.random.default_rng, st.integers(0, 9))),
           st.one_of(st.integers(max_value=-1), st.just(1.5), st.just("0"), st.just(True),
                     st.just([1, 2])), "seed")
stop_token_ids = arg(st.one_of(st.none(), st.lists(token, max_size=3),
                               st.lists(token, max_size=3).map(tuple),
                               st.lists(token, max_size=3).map(lambda t: np.array(t, np.int64))),
                     st.one_of(token, st.just("2"), st.lists(bad_token, min_size=1, max_size=2),
                               st.just([1.5]), st.just({1, 2}), st.just({1: 2})),
                     "stop_token_ids")


def check_raises_naming(call, names: set[str]) -> None:
    event("refused")  # hypothesis statistics (--hypothesis-show-statistics) count the outcomes
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert any(name in str(info.value) for name in names), (names, repr(info.value))


def check_tokens(tokens, batch: int, steps: int) -> None:
    event("generated")
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int64
    assert tokens.shape[0] == batch and 1 <= tokens.shape[1] <= steps
    assert ((tokens >= 0) & (tokens < V)).all()


def batch_of(input_ids) -> int:
    return len(input_ids)


# --------------------------------------------------------------------------------- runtime API
@fuzz(120)
@given(key=st.sampled_from([DEC, S2S]), prompt=prompts, steps=max_new_tokens, temperature=temperature,
       top_k=top_k, top_p=top_p, seed=seed, stops=stop_token_ids,
       callback=arg(st.sampled_from([None, lambda step, tokens: None]),
                    st.one_of(st.integers(), st.just("f")), "callback"),
       progress=arg(st.booleans(), st.one_of(st.just("no"), st.just(1), st.none()), "progress"))
def test_generate(loaded, key, prompt, steps, temperature, top_k, top_p, seed, stops, callback,
                  progress):
    _, model = loaded(key)
    ids, mask, bad = prompt
    drawn = (steps, temperature, top_k, top_p, seed, stops, callback, progress)
    names = set().union(bad or set(), *(d[1] for d in drawn if d[1]))
    kwargs = dict(max_new_tokens=steps[0], temperature=temperature[0], top_k=top_k[0],
                  top_p=top_p[0], seed=seed[0], stop_token_ids=stops[0], callback=callback[0],
                  progress=progress[0])
    call = lambda: model.generate(ids, mask, **kwargs)  # noqa: E731
    if names:
        check_raises_naming(call, names)
    else:
        check_tokens(call(), batch_of(ids), int(steps[0]))


@fuzz(60)
@given(prompt=prompts, steps=max_new_tokens, temperature=temperature)
def test_stream_checks_before_the_first_token(loaded, prompt, steps, temperature):
    _, model = loaded(DEC)
    ids, mask, bad = prompt
    names = set().union(bad or set(), steps[1] or set(), temperature[1] or set())
    call = lambda: model.stream(ids, mask, max_new_tokens=steps[0], temperature=temperature[0],  # noqa: E731
                                seed=0)
    if names:
        check_raises_naming(call, names)  # raised by stream() itself, not by the first next()
    else:
        tokens = np.stack(list(call()), axis=1)
        check_tokens(tokens, batch_of(ids), int(steps[0]))


@fuzz(30)
@given(key=st.sampled_from([DEC, S2S]), prompt=valid_prompts(), steps=positive_steps,
       temperature=st.sampled_from([1e-30, 1e-38, 1e-40, 1e-45, 5e-324, np.float32(1e-45)]),
       top_k=st.integers(0, 5), top_p=st.floats(0.05, 1))
def test_tiny_temperatures_are_greedy(loaded, key, prompt, steps, temperature, top_k, top_p):
    # Below float32's smallest normal, logits / temperature used to overflow to inf, inf - inf
    # gave NaN and argmax picked token 0 for every step.
    _, model = loaded(key)
    ids, mask = prompt
    greedy = model.generate(ids, mask, max_new_tokens=steps, stop_token_ids=())
    sampled = model.generate(ids, mask, max_new_tokens=steps, stop_token_ids=(),
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    np.testing.assert_array_equal(sampled, greedy)


@fuzz(80)
@given(prompt=prompts,
       pooling=arg(st.sampled_from(POOLINGS), st.one_of(st.just("median"), st.just(1), st.just("CLS")),
                   "pooling"),
       normalize=arg(st.booleans(), st.one_of(st.just("no"), st.just(1), st.just("yes")), "normalize"),
       types=arg(st.just(None), st.one_of(st.just([[5, 6]]), st.just("0"), st.just(3)), "token_type_ids"))
def test_embed(loaded, prompt, pooling, normalize, types):
    _, model = loaded(ENC)
    ids, mask, bad = prompt
    names = set().union(bad or set(), *(d[1] for d in (pooling, normalize, types) if d[1]))
    call = lambda: model.embed(ids, mask, types[0], pooling=pooling[0], normalize=normalize[0])  # noqa: E731
    if names:
        check_raises_naming(call, names)
        return
    out = call()
    assert out.dtype == np.float32 and out.shape == (batch_of(ids), model.config.d_model)
    assert np.isfinite(out).all()
    if normalize[0]:
        np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 1.0, rtol=1e-5)


texts = arg(st.one_of(st.text(max_size=20), st.lists(st.text(max_size=12), min_size=1, max_size=3),
                      st.lists(st.text(max_size=12), min_size=1, max_size=3).map(tuple)),
            st.one_of(st.none(), st.just({"w": 1}), st.integers(), st.just([]), st.just([1]),
                      st.just([None]), st.just(b"w5 w7"), st.just(["ok", 3])),
            "texts", "prompts")


@fuzz(40)
@given(texts=texts)
def test_embed_text(loaded, texts):
    pytest.importorskip("tokenizers")
    _, model = loaded(ENC_TEXT)
    value, bad = texts
    if bad:
        check_raises_naming(lambda: model.embed_text(value), bad)
        return
    out = model.embed_text(value)
    assert out.shape == (1 if isinstance(value, str) else len(value), model.config.d_model)


@fuzz(40)
@given(texts=texts, steps=max_new_tokens)
def test_generate_text(loaded, texts, steps):
    pytest.importorskip("tokenizers")
    _, model = loaded(DEC_TEXT)
    (value, bad), names = texts, set().union(texts[1] or set(), steps[1] or set())
    call = lambda: model.generate_text(value, max_new_tokens=steps[0])  # noqa: E731
    if names:
        check_raises_naming(call, names)
        return
    out = call()
    event("generated")
    assert isinstance(out, str) if isinstance(value, str) else len(out) == len(value)


@fuzz(40)
@given(where=arg(st.just("export"),
                 st.one_of(st.sampled_from(["missing", "file", "long", "nul", "empty-dir"]),
                           st.integers(), st.none(), st.binary(max_size=4)),
                 "model_dir"),
       provider=arg(st.sampled_from(["cpu", "auto"]), st.one_of(st.sampled_from(["tpu", "CPU", ""]),
                                                                 st.integers(), st.none()), "provider"),
       threads=arg(st.integers(0, 2), st.one_of(st.integers(max_value=-1), st.just(2**40), st.just(1.5),
                                                 st.just("2"), st.just(True)), "intra_op_threads"),
       optimization=arg(st.sampled_from(["disable", "basic", "extended", "all"]),
                        st.one_of(st.just("max"), st.none(), st.integers()), "graph_optimization"),
       device=arg(st.just(0), st.one_of(st.integers(max_value=-1), st.just(2**40), st.just("0")), "device_id"),
       verify=arg(st.sampled_from(["full", "fast", "none"]),
                  st.one_of(st.just("yes"), st.just(True), st.none(), st.just("FULL")), "verify"))
def test_load_model(exports, tmp_path_factory, where, provider, threads, optimization, device, verify):
    places = {"export": exports(DEC).path, "missing": Path("/nonexistent/tfport"),
              "file": exports(DEC).path / "manifest.json", "long": "x" * 5000, "nul": "a\0b",
              "empty-dir": tmp_path_factory.getbasetemp()}
    model_dir = places.get(where[0], where[0]) if isinstance(where[0], str) else where[0]
    drawn = (where, provider, threads, optimization, device, verify)
    names = set().union(*(d[1] for d in drawn if d[1]))
    call = lambda: load_model(model_dir, provider[0], intra_op_threads=threads[0],  # noqa: E731
                              graph_optimization=optimization[0], device_id=device[0],
                              verify=verify[0])
    if names:
        check_raises_naming(call, names)
    else:
        assert call().config.family == "decoder"


# ------------------------------------------------------------------------------------------ CLI
number_text = st.one_of(st.sampled_from(["0", "1", "3", "-1", "1e-40", "nan", "inf", "0.5", "abc", "",
                                         "99999999999999999999", "2.5", "5e-324"]),
                        st.text(alphabet="0123456789.-e", max_size=5))
ids_text = st.one_of(st.sampled_from(["1,2,3", "1,,2", "1,2,", ",", "", " ", "1 2", "-1", "96", "1, 5",
                                      "1;2", "0x5", "1,2,3,4,5,6,7,8"]),
                     st.text(alphabet="0123456789, -", max_size=8))
options = st.lists(st.one_of(
    st.tuples(st.just("--ids"), ids_text),
    st.tuples(st.just("--text"), st.text(alphabet="w0123456789 ", max_size=10)),
    st.tuples(st.sampled_from(["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                               "--batch-size"]), number_text),
    st.tuples(st.just("--threads"), st.sampled_from(["0", "1", "-3", "99999999999", "x"])),
    st.tuples(st.just("--provider"), st.sampled_from(["cpu", "auto", "tpu"])),
    st.tuples(st.just("--verify"), st.sampled_from(["full", "fast", "none", "yes"])),
    st.tuples(st.just("--pooling"), st.sampled_from(["cls", "mean", "median"])),
    st.tuples(st.sampled_from(["--stream", "--normalize", "--bogus"])),
), max_size=5)


@fuzz(80)
@given(command=st.sampled_from(["generate", "embed"]),
       where=st.sampled_from([DEC_TEXT, ENC_TEXT, S2S, "missing", "file"]), opts=options)
def test_cli(exports, capsys, command, where, opts):
    pytest.importorskip("tokenizers")
    places = {"missing": "/nonexistent/tfport", "file": str(exports(DEC).path / "manifest.json")}
    model_dir = places.get(where) or str(exports(where).path)
    argv = [command, model_dir, *[part for option in opts for part in option]]
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse: usage errors exit 2 (--help never drawn)
        code = exit.code
    captured = capsys.readouterr()
    assert code in (0, 2), (argv, code, captured.err)
    if code == 2:
        assert "error:" in captured.err, (argv, captured.err)
    assert "Traceback" not in captured.err, (argv, captured.err)


@fuzz(30)
@given(data=st.data())
def test_cli_valid_runs_succeed(exports, capsys, data):
    """Valid command lines only: exit 0, one output line per prompt (one when streaming)."""
    pytest.importorskip("tokenizers")
    draw = data.draw
    prompts = draw(st.lists(st.lists(token, min_size=1, max_size=6), min_size=1, max_size=3))
    separator = draw(st.sampled_from([",", ", "]))
    command = draw(st.sampled_from(["generate", "embed"]))
    key = draw(st.sampled_from([DEC_TEXT, S2S])) if command == "generate" else ENC_TEXT
    argv = [command, str(exports(key).path), "--verify", draw(st.sampled_from(["full", "fast", "none"]))]
    if key != S2S and draw(st.booleans()):
        argv += [part for p in prompts for part in ("--text", " ".join(f"w{max(i, 4)}" for i in p))]
    else:
        argv += [part for p in prompts for part in ("--ids", separator.join(map(str, p)))]
    streaming = False
    if command == "generate":
        argv += ["--max-new-tokens", str(draw(st.integers(1, 6)))]
        for option, values in (("--temperature", ["0", "0.7", "1e-40", "5"]), ("--top-k", ["0", "1", "50"]),
                               ("--top-p", ["0.01", "0.5", "1"]), ("--seed", ["0", "12345678901234567890"])):
            if draw(st.booleans()):
                argv += [option, draw(st.sampled_from(values))]
        streaming = len(prompts) == 1 and draw(st.booleans())
        argv += ["--stream"] * streaming
    else:
        argv += ["--pooling", draw(st.sampled_from(["cls", "mean"]))] + ["--normalize"] * draw(st.booleans())
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, (argv, captured.err)
    lines = captured.out.split("\n")
    assert lines[-1] == "" and len(lines) - 1 == (1 if streaming else len(prompts)), (argv, captured.out)
    if command == "embed":
        assert all(len(json.loads(line)) == 32 for line in lines[:-1])
