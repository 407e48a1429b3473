"""What an export says a decoding request leaves out (``RequestDefaults``: its
``generation_config.json``, ``tfport.generation.GenerationDefaults``, else the config's eos), the
APIs' sampling defaults (``GREEDY``, ``OPENAI``), and ``sequence_states``, which turns a resolved
request into the engine's per-sequence state. ``request.Request`` resolves against these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tfport.config import ModelConfig
from tfport.config.checks import is_integer
from tfport.generation import GenerationDefaults

from .decoding.engine import LogitsProcessor, SequenceState
from .sampling import Penalties, SamplingParams, make_rng

# The sampling a request gets where neither it nor the export says anything: the library is
# greedy (as transformers' generate); the OpenAI API's documented default is temperature 1.
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
OPENAI = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


class RequestDefaults:
    """What one export says a request leaves out: its ``config`` (eos) and ``generation``
    (generation_config.json, or None). ``request.Request`` resolves against it."""

    def __init__(self, config: ModelConfig, generation: GenerationDefaults | None):
        self.config = config
        self.generation = generation

    def sampling(self, unsaid: Mapping[str, float] = GREEDY) -> dict:
        """``temperature``, ``top_k`` and ``top_p`` from generation_config.json where it samples
        (``do_sample: true``), else ``unsaid``, the API's: greedy for the library, OpenAI's
        temperature 1 for the server (``OPENAI``)."""
        sampled = self.generation is not None and self.generation.do_sample
        return dict(self.generation.sampling if sampled else unsaid)

    @property
    def repetition_penalty(self) -> float | None:
        """generation_config.json's repetition penalty (None: without one)."""
        return None if self.generation is None else self.generation.repetition_penalty

    def stop_ids(self) -> tuple[int, ...]:
        """Every eos id of generation_config.json, else the config's eos (``()``: none)."""
        if self.generation is not None and self.generation.eos_token_ids:
            return self.generation.eos_token_ids
        eos = self.config.eos_token_id
        return () if eos is None else (eos,)

    def forced(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """generation_config.json's forced ids: (the first token's, the last step's)."""
        defaults = self.generation or GenerationDefaults()
        bos = defaults.forced_bos_token_id
        return (() if bos is None else (bos,)), tuple(defaults.forced_eos_token_ids)


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
    if logprobs is not None and (not is_integer(logprobs) or logprobs < 0):
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
