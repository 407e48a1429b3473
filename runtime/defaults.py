"""What a decoding request leaves out, resolved in one place: the caller's value, else the
export's ``generation_config.json`` (``tfport.generation.GenerationDefaults``), else the config's
(eos), else the library's (greedy). ``Model.generate`` / ``stream`` / ``chat``, the CLI and the
server all ask ``Model.defaults`` (``Model.sampling``, ``stop_ids`` and ``forced_tokens`` are its
methods), and ``sequence_state`` turns the resolved values into the engine's per-sequence state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfport.config import ModelConfig
from tfport.generation import GenerationDefaults

from .decoding.engine import LogitsProcessor, SequenceState
from .sampling import Penalties, SamplingParams, make_rng

# The sampling a request gets where neither it nor the export says anything: the library is
# greedy (as transformers' generate); the OpenAI API's documented default is temperature 1.
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
OPENAI = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
# Options of ``SamplingParams`` a request may set: off unless it asks, but for
# ``repetition_penalty``, which defaults to the export's generation_config.json.
REQUEST_OPTIONS = frozenset({"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                             "logit_bias"})


class RequestDefaults:
    """The defaults of one export: its ``config`` and ``generation`` (generation_config.json, or
    None)."""

    def __init__(self, config: ModelConfig, generation: GenerationDefaults | None):
        self.config = config
        self.generation = generation

    def sampling(self, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, *, unsaid: dict = GREEDY) -> dict:
        """The sampling arguments a request decodes with: those given; the rest from the export's
        generation_config.json where it samples (``do_sample: true``); else ``unsaid``, the
        caller's API default: greedy for the library (``generate``, ``chat``, the CLI), OpenAI's
        temperature 1 for the server (``OPENAI``)."""
        sampled = self.generation is not None and self.generation.do_sample
        defaults = self.generation.sampling if sampled else unsaid
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        return {k: defaults[k] if v is None else v for k, v in given.items()}

    def params(self, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, *, unsaid: dict = GREEDY, **options: Any) -> SamplingParams:
        """The ``SamplingParams`` a request decodes with: ``sampling``'s three, and ``options``
        (``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias``) where not None, else off (``repetition_penalty``: the export's
        generation_config.json, else off). ``ValueError`` naming a bad one."""
        unknown = sorted(set(options) - REQUEST_OPTIONS)
        if unknown:
            raise TypeError(f"unexpected sampling option(s) {unknown}: expected {sorted(REQUEST_OPTIONS)}")
        given = {k: v for k, v in options.items() if v is not None}
        if self.generation is not None:
            given.setdefault("repetition_penalty", self.generation.repetition_penalty)
        if "logit_bias" in given:
            given["logit_bias"] = dict(given["logit_bias"])
        return SamplingParams(**self.sampling(temperature, top_k, top_p, unsaid=unsaid), **given)

    def stop_ids(self, stop_token_ids: Sequence[int] | None = None) -> tuple[int, ...]:
        """The stop ids ``generate`` uses: ``stop_token_ids`` checked, else every eos id of the
        export's generation_config.json, else the config's eos."""
        if stop_token_ids is None:
            if self.generation is not None and self.generation.eos_token_ids:
                return self.generation.eos_token_ids
            eos = self.config.eos_token_id
            return () if eos is None else (eos,)
        if isinstance(stop_token_ids, np.ndarray):
            stop_token_ids = stop_token_ids.tolist() if stop_token_ids.ndim == 1 else stop_token_ids
        if isinstance(stop_token_ids, (int, str)) or not isinstance(stop_token_ids, Sequence):
            raise TypeError(f"stop_token_ids={stop_token_ids!r}: expected a sequence of token "
                            "ids (or None for the config's eos_token_id)")
        odd = [i for i in stop_token_ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))]
        if odd:
            raise TypeError(f"stop_token_ids: {odd} are not integer token ids")
        stops = tuple(int(i) for i in stop_token_ids)
        bad = [i for i in stops if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad} outside [0, {self.config.vocab_size})")
        return stops


    def forced_tokens(self, forced_bos_token_id: int | tuple[()] | None = None,
                      forced_eos_token_id: int | Sequence[int] | None = None, max_new_tokens: int = 16,
                      one_token_start: bool = True) -> dict[int, tuple[int, ...]]:
        """The steps ``generate`` forces -> the ids allowed there, as transformers' ForcedBOS /
        ForcedEOS logits processors do: ``forced_bos_token_id`` at step 0 when the decoder starts
        from one token (``one_token_start``: a seq2seq model's start token, or a one-token
        prompt), ``forced_eos_token_id`` (an id or several) at the last of ``max_new_tokens``
        steps, where transformers' ``max_length`` (prompt + ``max_new_tokens``) runs out; a forced
        eos wins when both fall on one step. Each None takes the export's generation_config.json
        (none without one); ``()`` forces nothing."""
        defaults = self.generation or GenerationDefaults()
        bos = self._forced_ids("forced_bos_token_id", forced_bos_token_id,
                               () if defaults.forced_bos_token_id is None else (defaults.forced_bos_token_id,))
        if len(bos) > 1:
            raise ValueError(f"forced_bos_token_id={forced_bos_token_id!r}: expected one token id, () or None")
        eos = self._forced_ids("forced_eos_token_id", forced_eos_token_id, defaults.forced_eos_token_ids)
        forced = {0: bos} if bos and one_token_start else {}
        if eos:
            forced[max_new_tokens - 1] = eos
        return forced

    def _forced_ids(self, argument: str, value, default: tuple[int, ...]) -> tuple[int, ...]:
        if value is None:
            return default
        ids = [value] if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) \
                or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
            raise TypeError(f"{argument}={value!r}: expected a token id, a sequence of them, () for "
                            "none or None for the export's")
        bad = [int(i) for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"{argument}: {bad} outside [0, {self.config.vocab_size})")
        return tuple(int(i) for i in ids)


def sequence_states(count: int, params: SamplingParams, seed: int | np.random.Generator | None,
                    max_tokens: int, stop_ids: tuple[int, ...] = (),
                    forced: Mapping[int, tuple[int, ...]] | None = None,
                    processors: Sequence[LogitsProcessor] = (), *,
                    prompts: Sequence[Sequence[int]] = (), vocab_size: int | None = None,
                    logprobs: int | None = None) -> list[SequenceState]:
    """The engine's states of ``count`` sequences decoded together with the same arguments: one
    random generator from ``seed`` (``make_rng``) shared by all, none when greedy without a seed.

    When ``params`` has a bias or penalty, each state's first processor applies it
    (``Penalties``) over its prompt, ``prompts[b]`` (the repetition penalty counts the prompt's
    tokens), with ``logit_bias`` ids checked against ``vocab_size``. ``logprobs``: each state
    records its tokens' log-probabilities with that many alternatives (None: not recorded)."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                 or logprobs < 0):
        raise ValueError(f"logprobs={logprobs!r}: expected an integer >= 0 (the alternatives "
                         "reported per token) or None")
    if params.penalised and (len(prompts) != count or vocab_size is None):
        raise ValueError(f"prompts: penalties need each of the {count} sequences' prompt and the "
                         f"vocab_size, got {len(prompts)} prompts and vocab_size={vocab_size!r}")
    rng = None if params.greedy and seed is None else make_rng(seed)
    return [SequenceState(params, rng, max_tokens, stop_ids, forced or {},
                          ((Penalties(params, prompts[b], vocab_size),) if params.penalised else ())
                          + tuple(processors), logprobs=logprobs)
            for b in range(count)]
