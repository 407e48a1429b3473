"""Constrained decoding (structured output): a logits processor that lets a row pick only tokens
that keep its output inside a JSON schema, a regular expression or a context-free grammar.

    constraint = compile_constraint(model.tokenizer, model.config.vocab_size, json_schema=schema)
    state.processors = (constraint.processor(state.stop_ids),)   # one fresh processor per row

The masks come from llguidance (extra ``text``; no dependencies, no torch), over the export's
``tokenizer.json``. A ``Constraint`` is the grammar compiled once for one tokenizer (cached by the
tokenizer file, the logits' width, the kind and the sha256 of the text); its ``processor`` is a
``LogitsProcessor`` (``engine``) holding one llguidance matcher for one row. The processor
advances its matcher from the tokens the engine hands it (rolling back when they are shorter or
differ), so it holds under every entry point: fixed batches, continuous batching and speculative
verification, where ``verify`` asks for the mask after each accepted proposal.

The row's stop ids stand in for the grammar's end: they are allowed exactly where the grammar
accepts, and are the only choice once it is complete, so a constrained row ends with "stop" when
its output is whole (or with "length" when ``max_tokens`` runs out first). A row that can no
longer continue (a forced token the grammar refuses) is ended the same way, with a warning.

JSON is compiled compact with the separators ``", "`` and ``": "`` (``JSON_OPTIONS``; no free
whitespace, which a model can repeat forever); a schema's ``x-guidance`` key overrides them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfport.config.checks import is_integer

from ..tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "grammar")
# llguidance's JSON options (overridable per schema with "x-guidance").
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled constraints kept (a server sees many schemas)
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("constrained decoding (json_schema, regex, grammar, response_format) needs "
                          "the 'llguidance' package (pip install 'tfport[text]')") from None
    return llguidance


class _Cache:
    """A small thread-safe LRU: key -> value, made by ``make()`` outside the lock on a miss."""

    def __init__(self, size: int):
        self.size = size
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


_TOKENIZERS = _Cache(8)  # llguidance tokenizers: about 1 s each to build for a 49k vocabulary
_CONSTRAINTS = _Cache(CACHE_SIZE)


def _grammar_tokenizer(tokenizer: TextTokenizer, vocab_size: int) -> tuple[tuple, Any, int]:
    """(a key naming it, llguidance's ``LLTokenizer`` over ``tokenizer``'s file with at least
    ``vocab_size`` ids, the id it treats as end of text). Ids past the file's vocabulary are
    never allowed."""
    stat = os.stat(tokenizer.path)
    key = (str(tokenizer.path.resolve()), stat.st_mtime_ns, stat.st_size, vocab_size)

    def make():
        from tokenizers import Tokenizer

        llguidance = _llguidance()
        text = tokenizer.path.read_text(encoding="utf-8")
        size = max(vocab_size, Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True))
        # llguidance needs an end-of-text id; the processor maps it to each row's stop ids, so
        # any special token will do (a special token is never allowed as text).
        special = sorted(tokenizer.special_ids())
        eos = special[0] if special else 0
        try:
            return llguidance.LLTokenizer(text, n_vocab=size, eos_token=eos), eos
        except ValueError as err:  # e.g. a decoder it does not know
            raise ValueError(f"tokenizer: llguidance cannot read {str(tokenizer.path)!r} ({err}), so "
                             "this export's output cannot be constrained") from None

    return (key, *_TOKENIZERS.get(key, make))


def _source(json_schema, regex, grammar) -> tuple[str, str]:
    """The one constraint given -> (its argument name, its text: a schema as JSON)."""
    given = {name: value for name, value in zip(KINDS, (json_schema, regex, grammar)) if value is not None}
    if len(given) != 1:
        raise ValueError(f"{', '.join(given) or 'json_schema, regex, grammar'}: expected exactly one "
                         f"of {list(KINDS)}, got {len(given)}")
    (argument, value), = given.items()
    if argument == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"json_schema: not valid JSON ({err})") from None
        if not isinstance(value, (Mapping, bool)):
            raise TypeError(f"json_schema: expected a JSON schema (an object), got {type(value).__name__}")
        try:
            return argument, json.dumps(value)  # property order kept: the output follows it
        except (TypeError, ValueError) as err:  # values JSON cannot carry
            raise ValueError(f"json_schema: {err}") from None
    if not isinstance(value, str):
        raise TypeError(f"{argument}: expected a str, got {type(value).__name__}")
    return argument, value


def _grammar_text(argument: str, source: str) -> str:
    """llguidance's grammar of a constraint's text (``_source``)."""
    matcher = _llguidance().LLMatcher
    if argument == "json_schema":
        return matcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    if argument == "regex":
        return matcher.grammar_from_regex(source)
    return matcher.grammar_from_lark(source)


def with_response_format(options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of a chat with OpenAI's ``response_format`` turned into ``json_schema`` /
    ``regex`` / ``grammar`` (``constraint_arguments``); ``ValueError`` when a constraint is given
    twice."""
    options = dict(options)
    constraint = constraint_arguments(options.pop("response_format", None))
    given = [name for name in KINDS if options.get(name) is not None]
    if constraint and given:
        raise ValueError(f"response_format, {', '.join(given)}: give the output's constraint once")
    return {**options, **constraint}


def compile_constraint(tokenizer: TextTokenizer, vocab_size: int, *, json_schema: Any = None,
                       regex: str | None = None, grammar: str | None = None) -> "Constraint":
    """Exactly one of ``json_schema`` (a dict or its JSON text), ``regex`` (the whole output
    matches it) or ``grammar`` (Lark text as llguidance takes it: ``%json {...}`` embeds a schema,
    ``<|im_end|>`` names a special token), compiled for ``tokenizer`` and logits of width
    ``vocab_size`` -> a ``Constraint``, cached by (tokenizer file, ``vocab_size``, kind, sha256 of
    the text). ``ValueError`` naming the argument for a malformed one; ``ImportError`` without
    llguidance."""
    if not is_integer(vocab_size) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: expected a positive integer")
    argument, source = _source(json_schema, regex, grammar)
    tokenizer_key, llg_tokenizer, eos = _grammar_tokenizer(tokenizer, int(vocab_size))
    key = (tokenizer_key, argument, hashlib.sha256(source.encode("utf-8")).hexdigest())
    return _CONSTRAINTS.get(key, lambda: Constraint(argument, _grammar_text(argument, source), llg_tokenizer,
                                                    eos, int(vocab_size)))


class Constraint:
    """One grammar compiled for one tokenizer (``compile_constraint``): ``processor`` makes the
    per-row processors, each from a copy of the compiled matcher (microseconds)."""

    def __init__(self, argument: str, text: str, llg_tokenizer, eos: int, vocab_size: int):
        llguidance = _llguidance()
        self.argument = argument
        self.vocab_size = vocab_size
        self.eos = eos
        self._matcher = llguidance.LLMatcher(llg_tokenizer, text, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"{argument}: {self._matcher.get_error()}")

    def processor(self, stop_ids: Sequence[int]) -> "GrammarProcessor":
        """A fresh processor for one row ending at any of ``stop_ids`` (at least one)."""
        stops = tuple(int(i) for i in stop_ids)
        if not stops:
            raise ValueError(f"{self.argument}: a constrained row needs a stop token id to end when "
                             "its output is complete; stop_token_ids=() has none")
        return GrammarProcessor(self._matcher.deep_copy(), self._matcher, stops, self.eos, self.argument)


class GrammarProcessor:
    """One row's constraint (a ``LogitsProcessor``): (tokens so far, logits [V]) -> logits [V]
    with every token the grammar refuses at -inf; the row's stop ids stand for the grammar's end."""

    def __init__(self, matcher, template, stop_ids: tuple[int, ...], eos: int, argument: str):
        self._matcher, self._template = matcher, template
        self.stop_ids = np.array(stop_ids, dtype=np.int64)
        self._stops = frozenset(stop_ids)
        self.eos = eos
        self.argument = argument
        self._seen: list[int] = []  # the tokens the matcher has consumed
        self.failed = False  # the matcher was handed a token its grammar refuses

    def __call__(self, tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        self._sync(tokens)
        np.copyto(logits, -np.inf, where=~self.mask(logits.shape[-1]))  # in place: the cheapest
        if logits.max() == -np.inf:  # nothing the grammar allows is left (forced tokens)
            logger.warning("%s: no token allowed at step %d (a forced token the grammar refuses?); "
                           "ending the row", self.argument, len(tokens))
            logits[self.stop_ids[self.stop_ids < len(logits)]] = 0.0
        return logits

    def mask(self, vocab_size: int) -> np.ndarray:
        """bool [vocab_size]: the tokens allowed next (the stop ids where the grammar may end)."""
        allowed = np.zeros(vocab_size, dtype=bool)
        if self.failed:
            ends = True
        else:
            bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), np.uint8),
                                 bitorder="little")[:vocab_size]
            allowed[:len(bits)] = bits
            ends = bool(bits[self.eos])
            allowed[self.eos] = False  # llguidance's end of text; the row's stop ids stand for it
        allowed[self.stop_ids[self.stop_ids < vocab_size]] = ends
        return allowed

    def _sync(self, tokens: Sequence[int]) -> None:
        """Bring the matcher to ``tokens``: roll back what differs, consume what is new."""
        seen = self._seen
        common = len(seen)
        if len(tokens) < common or list(tokens[:common]) != seen:
            common = next((i for i, (a, b) in enumerate(zip(seen, tokens)) if a != int(b)),
                          min(len(seen), len(tokens)))
            if self.failed or not self._matcher.rollback(len(seen) - common):
                self._matcher, self.failed, common = self._template.deep_copy(), False, 0
            del seen[common:]
        for token in tokens[len(seen):]:
            token = int(token)
            seen.append(token)
            if self.failed:
                continue
            if not self._matcher.consume_token(self.eos if token in self._stops else token):
                self.failed = True
                logger.warning("%s: token %d is outside the grammar (%s); the row ends at its next "
                               "step", self.argument, token, self._matcher.get_error()[:200])


def constraint_arguments(response_format: Mapping[str, Any] | None) -> dict[str, Any]:
    """OpenAI's ``response_format`` -> the keyword arguments of ``compile_constraint`` /
    ``Model.generate``: ``{"type": "text"}`` (or None) -> ``{}``; ``json_object`` -> any JSON
    object; ``json_schema`` (``{"name", "schema", "strict", "description"}``) -> its schema;
    extensions ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": <Lark>}``.
    ``ValueError`` naming the field (``response_format.json_schema.schema``)."""
    if response_format is None:
        return {}
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format: expected an object such as {{'type': 'json_object'}}, got "
                         f"{type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type={_short(kind)}: expected one of {list(RESPONSE_FORMATS)}")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind in ("regex", "grammar"):
        value = response_format.get(kind)
        if not isinstance(value, str) or not value:
            raise ValueError(f"response_format.{kind}: expected a non-empty str with type {kind!r}")
        return {kind: value}
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema: expected an object {'name': ..., 'schema': {...}, "
                         f"'strict': true}}, got {type(spec).__name__}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"response_format.json_schema.name={_short(name)}: expected a non-empty str")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ValueError(f"response_format.json_schema.schema: expected a JSON schema object, got "
                         f"{type(schema).__name__}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"response_format.json_schema.strict={_short(strict)}: expected true, false or null")
    return {"json_schema": dict(schema)}


def _short(value: Any, chars: int = 40) -> str:
    """``value``'s repr, cut to ``chars`` characters (a rejected request value is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= chars else f"{text[:chars]}... ({len(text):,} characters)"
