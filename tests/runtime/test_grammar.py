"""Constrained decoding (runtime/decoding/grammar.py): masks against a reference enumeration of
the language, schema-valid JSON (checked by jsonschema) from a tiny random model whose free output
is not JSON, on both cache layouts, with speculation and in the CLI; errors name the argument."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from tfport.cli import main
from tfport.runtime import load_model
from tfport.runtime.decoding.grammar import compile_constraint, constraint_arguments
from tfport.runtime.decoding.speculative import Speculation, SpeculationStats

from .grammar_cases import VOCAB_SIZE, byte_decoder, schema_family

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (extra 'text')")
pytest.importorskip("tokenizers", reason="constrained decoding needs tokenizers (extra 'text')")
jsonschema = pytest.importorskip("jsonschema", reason="the JSON reference is jsonschema (extra 'dev')")

EOS = 2  # [EOS] of grammar_cases' tokenizer, the tiny decoder's eos_token_id
# target -> cache layout: "portable" concatenates, "ort" writes one buffer in place.
TARGETS = ["portable", "ort"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {target: load_model(byte_decoder(tmp_path_factory, target), intra_op_threads=1)
            for target in TARGETS}


def text_of(model, row) -> tuple[str, bool]:
    """(the text before the first EOS, whether the row stopped there)."""
    ids = [int(t) for t in row]
    stopped = EOS in ids
    return model.tokenizer.decode(ids[:ids.index(EOS)] if stopped else ids), stopped


# ------------------------------------------------------------------------------ masks vs reference
WORDS = ["cat", "cats", "dog", "dogs", "bird", "birds"]


def test_masks_equal_the_languages_prefixes(models):
    """Along every word of a finite language, the allowed set is exactly the tokens whose text
    continues the prefix towards some word, plus the stop id where the prefix is a word."""
    model = models["portable"]
    tokenizer = model.tokenizer
    constraint = compile_constraint(tokenizer, VOCAB_SIZE, regex="(cat|dog|bird)s?")
    texts = {t: tokenizer.decode([t], skip_special_tokens=False) for t in range(VOCAB_SIZE)
             if tokenizer.token(t) is not None and t not in tokenizer.special_ids()}
    for word in WORDS:
        processor = constraint.processor((EOS,))
        ids = tokenizer.encode(word, add_special_tokens=False)
        for step in range(len(ids) + 1):
            prefix = tokenizer.decode(ids[:step])
            expected = np.zeros(VOCAB_SIZE, dtype=bool)
            for t, piece in texts.items():
                expected[t] = any(w.startswith(prefix + piece) for w in WORDS)
            expected[EOS] = prefix in WORDS
            logits = np.zeros(VOCAB_SIZE, np.float32)
            allowed = np.isfinite(processor(ids[:step], logits))
            np.testing.assert_array_equal(allowed, expected, err_msg=f"{word!r} after {prefix!r}")


def test_ids_past_the_tokenizer_are_never_allowed(models):
    """The ONNX vocabulary (272) is wider than the tokenizer's: those ids stay masked, even
    under a grammar that allows any text."""
    tokenizer = models["portable"].tokenizer
    size = max(tokenizer.special_ids() | {t for t in range(VOCAB_SIZE) if tokenizer.token(t)}) + 1
    assert size < VOCAB_SIZE
    processor = compile_constraint(tokenizer, VOCAB_SIZE, regex="(?s:.*)").processor((EOS,))
    allowed = processor.mask(VOCAB_SIZE)
    assert not allowed[size:].any() and allowed[3:size].any()


def test_processor_follows_tokens_that_shrink_or_change(models):
    """Handed a shorter or different token list (a rewound row), the processor's mask is the one
    a fresh processor gives for that list."""
    tokenizer = models["portable"].tokenizer
    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "name": {"type": "string", "maxLength": 4}},
              "additionalProperties": False}
    constraint = compile_constraint(tokenizer, VOCAB_SIZE, json_schema=schema)
    zeros = np.zeros(VOCAB_SIZE, np.float32)
    path = tokenizer.encode('{"id": 12', add_special_tokens=False)
    moved = constraint.processor((EOS,))
    moved(path, zeros)
    masks = []
    for tokens in (path[:3], tokenizer.encode('{"name": "ab', add_special_tokens=False), []):
        moved(tokens, zeros)
        fresh = constraint.processor((EOS,))
        fresh(tokens, zeros)
        masks.append(fresh.mask(VOCAB_SIZE))
        np.testing.assert_array_equal(moved.mask(VOCAB_SIZE), masks[-1], err_msg=tokenizer.decode(tokens))
    assert not np.array_equal(masks[1], masks[2])  # the lists do differ in what they allow


# --------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("target", TARGETS)
def test_json_schema_family_is_valid_where_free_output_is_not(models, target):
    model = models[target]
    prompt = model.tokenizer.encode("Data:")
    schemas = schema_family(8, seed=1)
    for index, schema in enumerate(schemas):
        row, = model.generate([prompt], max_new_tokens=200, json_schema=schema, temperature=1.0, seed=index)
        text, stopped = text_of(model, row)
        assert stopped, f"schema {index}: not finished in 200 tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)
    free, = model.generate([prompt], max_new_tokens=40, temperature=1.0, seed=0, stop_token_ids=())
    with pytest.raises(ValueError):  # the reference: the random model alone writes no JSON
        json.loads(text_of(model, free)[0])


@pytest.mark.parametrize("target", TARGETS)
def test_constrained_rows_batch_and_speculate(models, target):
    """A batch of rows each keeps its own grammar state, and speculative decoding (the engine's
    verify asks for each accepted position's mask) gives the greedy tokens of plain decoding."""
    model = models[target]
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tags": {"type": "array", "maxItems": 3,
                                                        "items": {"enum": ["a", "b", "c"]}}},
              "required": ["id", "tags"], "additionalProperties": False}
    prompts = [model.tokenizer.encode(p) for p in ("one", "a longer prompt", "x y z")]
    plain = model.generate(prompts, max_new_tokens=60, json_schema=schema)
    for row in plain:
        text, stopped = text_of(model, row)
        assert stopped
        jsonschema.validate(json.loads(text), schema)
    for drafter in ("lookup", model):  # the model drafts for itself: unconstrained proposals
        stats = SpeculationStats()
        fast = model.generate(prompts, max_new_tokens=60, json_schema=schema,
                              speculative=Speculation(drafter, 4, adaptive=False), speculation=stats)
        np.testing.assert_array_equal(fast, plain)
        assert 0 < stats.accepted < stats.proposed, stats  # proposals kept and refused


def test_regex_and_lark_with_embedded_json(models):
    model = models["ort"]
    prompt = model.tokenizer.encode("Go:")
    row, = model.generate([prompt], max_new_tokens=30, regex=r"[A-Z]{2}-[0-9]{3}", temperature=1.0, seed=0)
    text, stopped = text_of(model, row)
    assert stopped and len(text) == 6 and text[:2].isupper() and text[2] == "-" and text[3:].isdigit()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    lark = f'start: "<call>" args "</call>"\nargs: %json {json.dumps(schema)}'
    row, = model.generate([prompt], max_new_tokens=40, grammar=lark, temperature=1.0, seed=0)
    text, stopped = text_of(model, row)
    assert stopped and text.startswith("<call>") and text.endswith("</call>")
    jsonschema.validate(json.loads(text[len("<call>"):-len("</call>")]), schema)


def test_chat_response_format(models):
    model = models["ort"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "ok?"}]
    jsonschema.validate(json.loads(model.chat(messages, max_new_tokens=40, response_format=fmt)), schema)
    pieces = model.chat_stream(messages, max_new_tokens=40, response_format=fmt, temperature=1.0, seed=1)
    jsonschema.validate(json.loads("".join(pieces)), schema)


def test_json_object_starts_an_object(models):
    """json_object is any JSON object (compact): the first token must open one. (A random model's
    free object need not end in a bounded number of tokens, so this checks the mask.)"""
    tokenizer = models["ort"].tokenizer
    constraint = compile_constraint(tokenizer, VOCAB_SIZE, **constraint_arguments({"type": "json_object"}))
    processor = constraint.processor((EOS,))
    allowed = np.isfinite(processor([], np.zeros(VOCAB_SIZE, np.float32)))
    expected = [t for t in range(VOCAB_SIZE) if tokenizer.token(t) is not None
                and t not in tokenizer.special_ids() and tokenizer.decode([t]).startswith("{")]
    assert np.flatnonzero(allowed).tolist() == expected and len(expected) == 2  # "{" and '{"'


def test_forced_token_outside_the_grammar_ends_the_row(models, caplog):
    model = models["portable"]
    letter = model.tokenizer.encode("a", add_special_tokens=False)[0]
    with caplog.at_level(logging.WARNING, logger="tfport.runtime.decoding.grammar"):
        row, = model.generate([[5]], max_new_tokens=8, regex="[0-9]+", forced_bos_token_id=letter)
    assert row.tolist()[0] == EOS and "no token allowed" in caplog.text


def test_constraints_are_cached(models):
    tokenizer = models["ort"].tokenizer
    schema = schema_family(1, seed=7)[0]
    first = compile_constraint(tokenizer, VOCAB_SIZE, json_schema=schema)
    assert compile_constraint(tokenizer, VOCAB_SIZE, json_schema=json.dumps(schema)) is first
    assert compile_constraint(tokenizer, VOCAB_SIZE, regex="a+") is not first


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, match", [
    ({"json_schema": {"type": "strin"}}, "json_schema: Invalid type: strin"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 2}}, "json_schema: Unsatisfiable"),
    ({"json_schema": "{not json"}, "json_schema: not valid JSON"),
    ({"json_schema": [1]}, "json_schema: expected a JSON schema"),
    ({"regex": "(("}, "(?s)regex: .*unclosed group"),
    ({"grammar": "start: foo"}, "(?s)grammar: .*unknown name"),
    ({"regex": "a", "grammar": 'start: "a"'}, "regex, grammar: expected exactly one"),
])
def test_malformed_constraints_name_the_argument(models, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        models["portable"].generate([[5, 6]], max_new_tokens=4, **kwargs)


def test_a_tokenizer_llguidance_cannot_read_is_named(tmp_path):
    """runtime_cases' word-level tokenizer.json has no decoder llguidance knows."""
    from tfport.presets import get_preset
    from tfport.runtime.tokenizer import TextTokenizer

    from .runtime_cases import write_tokenizer

    config = get_preset("tiny-decoder")
    tokenizer = TextTokenizer(write_tokenizer(tmp_path / "tokenizer.json", config))
    with pytest.raises(ValueError, match="tokenizer: llguidance cannot read .*tokenizer.json"):
        compile_constraint(tokenizer, config.vocab_size, json_schema={"type": "object"})


def test_a_constrained_row_needs_a_stop_id(models):
    with pytest.raises(ValueError, match="stop_token_ids=\\(\\) has none"):
        models["portable"].generate([[5, 6]], max_new_tokens=4, regex="a+", stop_token_ids=())


@pytest.mark.parametrize("response_format, expected", [
    (None, {}),
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"json_schema": {"type": "object"}}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True}},
     {"json_schema": {"type": "integer"}}),
    ({"type": "regex", "regex": "a+"}, {"regex": "a+"}),
    ({"type": "grammar", "grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
])
def test_response_format_arguments(response_format, expected):
    assert constraint_arguments(response_format) == expected


@pytest.mark.parametrize("response_format, match", [
    ({"type": "xml"}, "response_format.type='xml'"),
    ({"type": "json_schema"}, "response_format.json_schema: expected an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name=None"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict='yes'"),
    ({"type": "regex"}, "response_format.regex: expected a non-empty str"),
    ("json", "response_format: expected an object"),
])
def test_malformed_response_formats_name_the_field(response_format, match):
    with pytest.raises(ValueError, match=match):
        constraint_arguments(response_format)


def test_chat_refuses_two_constraints(models):
    with pytest.raises(ValueError, match="response_format, regex: give the output's constraint once"):
        models["ort"].chat([{"role": "user", "content": "x"}], regex="a",
                           response_format={"type": "json_object"})


# ---------------------------------------------------------------------------------------- CLI
def test_cli_generate_and_chat_with_a_schema_file(models, tmp_path, capsys):
    schema = schema_family(1, seed=5)[0]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    directory = str(models["ort"].directory)
    assert main(["generate", directory, "--text", "Data:", "--max-new-tokens", "200", "--temperature", "1",
                 "--seed", "0", "--json-schema", str(path)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    assert main(["chat", directory, "--message", "hi", "--max-new-tokens", "200", "--json-schema",
                 str(path)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    assert main(["generate", directory, "--text", "x", "--regex", "[0-9]{4}", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out) == 4 and out.isdigit()
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"')
    assert main(["generate", directory, "--text", "x", "--grammar", str(grammar), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


def test_cli_errors_name_the_option(models, tmp_path, capsys):
    directory = str(models["ort"].directory)
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["generate", directory, "--text", "x", "--json-schema", str(bad)]) == 2
    assert "--json-schema" in capsys.readouterr().err
    assert main(["generate", directory, "--text", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "--json-schema" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one constraint at a time
        main(["generate", directory, "--text", "x", "--regex", "a", "--grammar", str(bad)])


def test_bench_script_runs(models, tmp_path):
    """export/bench/grammar.py on the tiny export (its numbers mean nothing here): every cell."""
    from tfport.tools.bench.grammar import main, schemas

    out = tmp_path / "grammar.json"
    assert main([str(models["ort"].directory), "--tokens", "8", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["per_token"]["tokens"] == 8 and result["per_token"]["mask_us_median"] > 0
    assert [c["schema"] for c in result["compile"]] == list(schemas())
