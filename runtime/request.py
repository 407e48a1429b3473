"""One decoding request: everything a caller asks of one decoding, checked once, with its
defaults resolved in one place.

A ``Request`` holds the caller's values as said (None: not said): the token budget, sampling and
penalties, the seed, stop and forced tokens, an output constraint, speculation and logprobs. It
checks each when it is made, naming the argument. What it leaves out comes from the export's
``generation_config.json`` (``defaults.RequestDefaults``), else from the API the request came
through (``ApiDefaults``): the library is greedy with 16 new tokens (256 for a chat), OpenAI's
completions sample at temperature 1 with 16, its chat as many as the context leaves.

``Model.generate`` / ``stream`` / ``chat``, ``tfport generate`` / ``chat`` and the server's
protocol layer translate their arguments into a ``Request``; nothing else reads them.

    >>> request = Request(max_new_tokens=32, temperature=0.7, seed=1)
    >>> model.generate([[1, 5, 7]], request=request)   # = model.generate(ids, max_new_tokens=32, ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tfport.config.checks import is_integer

from .defaults import GREEDY, OPENAI, RequestDefaults
from .sampling import SamplingParams, check_bias_ids

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias")
CONSTRAINTS = ("json_schema", "regex", "grammar")  # decoding.grammar's kinds, one at most


@dataclass(frozen=True)
class ApiDefaults:
    """What a request's API gives it where neither the request nor the export says:
    ``max_new_tokens`` (None: as many as the context leaves) and the sampling (``defaults.GREEDY``
    or ``defaults.OPENAI``)."""

    max_new_tokens: int | None
    sampling: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(GREEDY))


LIBRARY = ApiDefaults(16, GREEDY)           # Model.generate / stream, tfport generate
LIBRARY_CHAT = ApiDefaults(256, GREEDY)     # Model.chat / chat_stream, tfport chat
COMPLETIONS = ApiDefaults(16, OPENAI)       # /v1/completions: OpenAI's documented defaults
CHAT = ApiDefaults(None, OPENAI)            # /v1/chat/completions and /v1/responses


def split_request(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments of ``Model.generate`` -> (those that are a ``Request``'s fields, the
    rest: what the call collects or shows, ``logprobs``, ``speculation``, ``callback``,
    ``progress``)."""
    names = {f.name for f in dataclasses.fields(Request)}
    return ({k: v for k, v in options.items() if k in names},
            {k: v for k, v in options.items() if k not in names})


def _token_ids(argument: str, value: Any) -> tuple[int, ...]:
    """A sequence of token ids as a tuple of ints; ``TypeError`` naming ``argument`` otherwise."""
    if isinstance(value, np.ndarray):
        value = value.tolist() if value.ndim == 1 else value
    if isinstance(value, (int, str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{argument}={value!r}: expected a sequence of token ids")
    odd = [i for i in value if not is_integer(i)]
    if odd:
        raise TypeError(f"{argument}: {odd} are not integer token ids")
    return tuple(int(i) for i in value)


def _in_vocab(argument: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{argument}: {bad} outside [0, {vocab_size})")


def new_token_room(longest: int, context: int, seq2seq: bool) -> int:
    """New tokens a row fits after a prompt of ``longest`` tokens in ``context`` positions: a
    decoder feeds back every token but the last; an encoder-decoder's prompt is its encoder's,
    and its decoder starts from one start token."""
    return context if seq2seq else context - longest + 1


@dataclass(frozen=True)
class Request:
    """What one decoding asks (None: not said; see the module docstring for the defaults).

    ``max_new_tokens``: new tokens per row (a positive integer). Sampling
    (``sampling.SamplingParams`` says each range): ``temperature`` (0 greedy), ``top_k``,
    ``top_p``, ``min_p``; penalties ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty`` and ``logit_bias`` {token id: bias}. ``seed``: an integer >= 0 or a
    ``numpy.random.Generator``. ``stop_token_ids``: the ids that end a row (``()``: none; None:
    the export's eos ids). ``forced_bos_token_id`` / ``forced_eos_token_id``: forced at the first
    / last step (``()``: none; None: the export's). One of ``json_schema`` / ``regex`` /
    ``grammar`` constrains the output (``decoding.grammar``). ``speculative``: "lookup", a draft
    export or a ``Speculation``, with at most ``draft_tokens`` per step. ``top_logprobs``: the
    alternatives recorded with each generated token's log-probability (None: none recorded).
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    seed: int | np.random.Generator | None = None
    stop_token_ids: tuple[int, ...] | None = None
    forced_bos_token_id: int | tuple[()] | None = None
    forced_eos_token_id: int | tuple[int, ...] | None = None
    json_schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    speculative: Any = None
    draft_tokens: int | None = None
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and (not is_integer(self.max_new_tokens) or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected a positive integer")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias={self.logit_bias!r}: expected a mapping of token id -> "
                                 "bias in [-100, 100]")
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        SamplingParams(**self._sampling_given())  # each value's range, named
        seed = self.seed
        if not (seed is None or isinstance(seed, np.random.Generator) or (is_integer(seed) and seed >= 0)):
            raise ValueError(f"seed={seed!r}: expected a non-negative integer, a "
                             "numpy.random.Generator or None")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        for argument in ("forced_bos_token_id", "forced_eos_token_id"):
            value = getattr(self, argument)
            if value is None or is_integer(value):
                continue
            try:
                object.__setattr__(self, argument, _token_ids(argument, value))
            except TypeError:
                raise TypeError(f"{argument}={value!r}: expected a token id, a sequence of them, () "
                                "for none or None for the export's") from None
        if isinstance(self.forced_bos_token_id, tuple) and len(self.forced_bos_token_id) > 1:
            raise ValueError(f"forced_bos_token_id={self.forced_bos_token_id!r}: expected one token id, "
                             "() or None")
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{', '.join(given)}: expected exactly one output constraint, got {len(given)}")
        if self.draft_tokens is not None and self.speculative is None:
            raise ValueError(f"draft_tokens={self.draft_tokens!r}: applies with speculative=...")
        if self.top_logprobs is not None and (not is_integer(self.top_logprobs) or self.top_logprobs < 0):
            raise ValueError(f"top_logprobs={self.top_logprobs!r}: expected an integer >= 0 (the "
                             "alternatives recorded per token) or None")

    @classmethod
    def of(cls, request: Request | None = None, /, **options: Any) -> Request:
        """``request`` (None: the defaults) with ``options`` set: the keyword arguments of
        ``Model.generate`` / ``stream``, the fields of ``Request``. ``TypeError`` naming an
        unknown one."""
        if request is not None and not isinstance(request, Request):
            raise TypeError(f"request={request!r}: expected a tfport.runtime.Request or None")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unexpected argument(s) {unknown}: a request takes {sorted(names)}")
        if request is None:
            return cls(**options)
        return dataclasses.replace(request, **options) if options else request

    def replace(self, **changes: Any) -> Request:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------- resolving
    def _sampling_given(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def sampling(self, defaults: RequestDefaults, api: ApiDefaults = LIBRARY) -> dict[str, float]:
        """``temperature``, ``top_k`` and ``top_p`` as decoded: the request's; the rest from the
        export's generation_config.json where it samples, else the API's."""
        fallback = defaults.sampling(api.sampling)
        return {name: fallback[name] if getattr(self, name) is None else getattr(self, name)
                for name in ("temperature", "top_k", "top_p")}

    def params(self, defaults: RequestDefaults, api: ApiDefaults = LIBRARY) -> SamplingParams:
        """The ``SamplingParams`` decoded with: ``sampling``'s three; penalties, bias and ``min_p``
        as given, else off (``repetition_penalty``: the export's generation_config.json's, else
        off); ``logit_bias`` ids checked against the vocabulary."""
        given = self._sampling_given()
        if "repetition_penalty" not in given and defaults.repetition_penalty is not None:
            given["repetition_penalty"] = defaults.repetition_penalty
        params = SamplingParams(**{**given, **self.sampling(defaults, api)})
        check_bias_ids(params, defaults.config.vocab_size)
        return params

    def stop_ids(self, defaults: RequestDefaults) -> tuple[int, ...]:
        """The ids that end a row: ``stop_token_ids`` (in the vocabulary), else the export's."""
        if self.stop_token_ids is None:
            return defaults.stop_ids()
        _in_vocab("stop_token_ids", self.stop_token_ids, defaults.config.vocab_size)
        return self.stop_token_ids

    def forced(self, defaults: RequestDefaults, max_new_tokens: int, one_token_start: bool = True
               ) -> dict[int, tuple[int, ...]]:
        """The steps forced -> the ids allowed there, as transformers' ForcedBOS / ForcedEOS
        logits processors force them: ``forced_bos_token_id`` at step 0 when the decoder starts
        from one token (``one_token_start``: a seq2seq model's start token, or a one-token
        prompt), ``forced_eos_token_id`` (an id or several) at the last of ``max_new_tokens``
        steps; a forced eos wins when both fall on one step. Each None takes the export's."""
        vocab = defaults.config.vocab_size
        bos, eos = defaults.forced()
        if self.forced_bos_token_id is not None:
            bos = (int(self.forced_bos_token_id),) if is_integer(self.forced_bos_token_id) else self.forced_bos_token_id
            _in_vocab("forced_bos_token_id", bos, vocab)
        if self.forced_eos_token_id is not None:
            eos = (int(self.forced_eos_token_id),) if is_integer(self.forced_eos_token_id) else self.forced_eos_token_id
            _in_vocab("forced_eos_token_id", eos, vocab)
        forced = {0: bos} if bos and one_token_start else {}
        if eos:
            forced[max_new_tokens - 1] = eos
        return forced

    def token_budget(self, longest: int, context: int, *, seq2seq: bool = False,
                     api: ApiDefaults = LIBRARY, cap: int | None = None,
                     argument: str = "max_new_tokens") -> int:
        """New tokens per row after a longest prompt of ``longest`` tokens in ``context``
        positions: ``max_new_tokens``, else the API's default (None: all the room, up to
        ``cap``). ``ValueError`` naming ``argument`` (the name the caller used) when it is over
        ``cap`` (a server's ``--max-tokens``) or the room the context leaves."""
        room = new_token_room(longest, context, seq2seq)
        asked = self.max_new_tokens
        if asked is None and api.max_new_tokens is None:
            return room if cap is None else min(cap, room)
        tokens = asked if asked is not None else api.max_new_tokens if cap is None else min(api.max_new_tokens, cap)
        if cap is not None and tokens > cap:
            raise ValueError(f"{argument}={tokens}: more than this server's limit of {cap} per request "
                             "(--max-tokens)")
        if tokens > room:
            why = (f"the decoder's context is {context} tokens" if seq2seq else
                   f"a prompt of {longest} tokens leaves room for {room} new tokens in a context of "
                   f"{context} (the last token is not fed back)")
            raise ValueError(f"{argument}={tokens}: {why}; lower {argument} to at most {room}")
        return int(tokens)

    @property
    def constraint(self) -> dict[str, Any]:
        """The output constraint as ``decoding.grammar.compile_constraint`` takes it ({}: none)."""
        return {name: getattr(self, name) for name in CONSTRAINTS if getattr(self, name) is not None}
