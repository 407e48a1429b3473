"""Speculative decoding: a drafter proposes up to K tokens per row, the target verifies them all
in one forward on top of the row's cache, and the rows keep the accepted run (``engine.verify``)
and forget the rest (``RowBatch.rewind``).

    speculator = Speculator(batch, runner, Speculation("lookup"), PromptLookup(), stats)
    loop = DecodeLoop(batch, speculator)      # decoding.loop: each step verifies every row's proposal

(``speculate`` builds them for ``Model.stream``; the server's scheduler builds its own over its
running batch.)

Greedy output is token for token plain greedy decoding's; sampled output follows the target's
distribution exactly (the rejection rule). K is chosen per row and step by ``policy.KPolicy``
from the row's running acceptance rate and the measured cost of verifying: the K that maximises
the expected tokens per unit of target time, 0 (a plain step) when speculating does not pay; a
draft model drafts on while the policy says one more token pays (``KPolicy.keep_drafting``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .drafters import Drafter, DraftModel, PromptLookup, Proposal
from .engine import SequenceState, verify
from .loop import DecodeLoop, decode_rows
from .policy import KPolicy, VerifyCosts, measure_costs
from .rows import Row, RowBatch


@dataclass
class SpeculationStats:
    """What speculation did: ``proposed`` / ``accepted`` draft tokens; ``forwards``, the rows the
    target ran after the prefill, each verifying one row's run (or stepping it plainly: nothing
    proposed), and the ``tokens`` they gave; ``tokens_per_forward`` is 1 without speculation."""

    proposed: int = 0
    accepted: int = 0
    forwards: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"proposed": self.proposed, "accepted": self.accepted, "forwards": self.forwards,
                "tokens": self.tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_forward": round(self.tokens_per_forward, 4)}


class Speculator:
    """One decoding run's or scheduler's speculation over ``batch``: drafts, K per row, the
    verification of each row's run, and the statistics. Rows are named by any hashable key.

        proposals = speculator.propose(keys, contexts, states, rows)      # before a forward
        logits = speculator.forward([[last, *p.tokens] for each row])     # one target forward
        pushed, accepted, error = speculator.verify(key, row, state, logits, proposal)
    """

    def __init__(self, batch: RowBatch, runner, speculation: "Speculation", drafter: Drafter,
                 stats: SpeculationStats | None = None):
        self.batch, self.speculation = batch, speculation
        self.policy = KPolicy(speculation.draft_tokens, None)
        self.drafts = drafter.start(batch.capacity, batch.max_length)
        # A draft model drafts while the policy says one more token pays (up to K), not K always.
        self.steered = speculation.adaptive and hasattr(self.drafts, "keep")
        if self.steered:
            self.drafts.keep = self.policy.keep_drafting
        self.stats = stats if stats is not None else SpeculationStats()
        self.costs = runner.kept.setdefault(_COSTS, {})  # (rows, K) -> VerifyCosts, per session
        self.verify_costs: VerifyCosts | None = None  # the live rows' (adaptive only)

    def propose(self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]],
                states: Sequence[SequenceState], rows: Sequence[Row]) -> list[Proposal]:
        """Each live row's proposal (``rows`` are theirs in ``batch``): K from the policy, within
        the row's token budget and cache room."""
        k_max = self.policy.k_max
        if self.speculation.adaptive:
            key = (len(self.batch.rows), k_max)
            if key not in self.costs:
                self.costs[key] = measure_costs(self.batch, k_max)
            self.policy.cost = self.verify_costs = self.costs[key]
        # The row's token budget and cache room; a row with none left is not put to the policy
        # (a probe it was given would be spent with nothing proposed).
        room = [min(state.max_tokens - len(state.tokens) - 1, self.batch.max_length - row.length - 1)
                for state, row in zip(states, rows)]
        ks = [self.policy.k(key) if left > 0 else 0 for key, left in zip(keys, room)]
        if not self.policy.pays_for_batch(keys, ks):  # one row's proposal is every row's cost
            ks = [0] * len(ks)
        if self.steered:  # the draft stops where keep_drafting says (a plain step stays one)
            ks = [k and k_max for k in ks]
        ks = [max(0, min(k, left)) for k, left in zip(ks, room)]
        proposals = self.drafts.propose(keys, contexts, ks, states)
        if self.verify_costs is not None:  # a draft model's forwards (0 for prompt lookup)
            step = self.verify_costs.step_seconds
            self.policy.draft_cost = getattr(self.drafts, "step_seconds", 0.0) / step
            feed = getattr(self.drafts, "feed_seconds", None)
            self.policy.draft_feed = self.policy.draft_cost if feed is None else feed / step
        return proposals

    def forward(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        """The target forward verifying the live rows' ``chunks`` (``batch.extend``: each row's
        last token and its proposal), timed into the costs the policy reads when every row feeds
        as many tokens (the costs are per number of tokens each row feeds)."""
        start = time.perf_counter()
        logits = self.batch.extend(chunks)
        sizes = {len(chunk) for chunk in chunks}
        if self.verify_costs is not None and len(sizes) == 1:
            self.verify_costs.observe(sizes.pop(), time.perf_counter() - start)
        return logits

    def verify(self, key: Hashable, row: Row, state: SequenceState, logits: np.ndarray,
               proposal: Proposal) -> tuple[list[int], int, RuntimeError | None]:
        """Push the run ``state`` takes (``engine.verify``) and forget the rejected proposals in
        the row's cache -> (the tokens pushed, how many were accepted proposals, the error that
        ends the row or None); a row that ended is forgotten by the drafter."""
        offered = proposal.tokens
        pushed, error = verify(state, logits, offered, proposal.probs)
        accepted = next((n for n, (a, t) in enumerate(zip(pushed, offered)) if a != t),
                        min(len(pushed), len(offered)))
        self.stats.forwards += 1
        self.stats.proposed += len(offered)
        self.stats.accepted += accepted
        self.stats.tokens += len(pushed)
        self.policy.record(key, len(offered), accepted, proposal.confidences)
        if state.finish or error is not None:
            self.forget(key)
        else:
            self.batch.rewind(row, len(offered) - accepted)
        return pushed, accepted, error

    def forget(self, key: Hashable) -> None:
        self.drafts.forget(key)
        self.policy.forget(key)


# Verification costs measured once per (decoder session, rows, K): cost(s) functions.
_COSTS = "verify-costs"


@dataclass(frozen=True)
class Speculation:
    """How to speculate: ``drafter`` ("lookup", a draft export's directory, a draft ``Model`` or
    a ``Drafter``), at most ``draft_tokens`` proposals per step; ``adaptive`` chooses K per row
    and step (``KPolicy``: acceptance and measured cost, 0 where it does not pay), else always
    ``draft_tokens`` (within the token budget). ``exact`` refuses a quantised target, whose
    verified tokens can differ from plain decoding's (``check_speculative``); False accepts that.
    """

    drafter: object
    draft_tokens: int = 8
    adaptive: bool = True
    exact: bool = True  # refuse targets whose verified tokens can differ from plain decoding's


def speculate(model, rows: Sequence[np.ndarray], states: Sequence[SequenceState], speculative,
              draft_tokens: int | None, stats: SpeculationStats | None) -> Iterator[np.ndarray]:
    """``Model.stream``'s decoding with ``speculative`` (a ``Speculation``, or its ``drafter``
    alone); ``draft_tokens`` overrides its K. Checks everything before returning."""
    if not isinstance(speculative, Speculation):
        speculative = Speculation(speculative)
    if draft_tokens is not None:
        speculative = dataclasses.replace(speculative, draft_tokens=draft_tokens)
    KPolicy(speculative.draft_tokens, None)  # checks draft_tokens
    drafter = drafter_for(speculative.drafter, model)
    config = model.config
    if config.family != "decoder":
        raise ValueError(f"speculative: family {config.family!r} is not supported; speculative "
                         "decoding runs decoder-only exports")
    runner = model.runner("decoder", "generate")
    length = max(len(row) for row in rows) + max(state.max_tokens for state in states) + speculative.draft_tokens + 1
    # A single prompt starts from its longest cached prefix and leaves its keys and values, as in
    # plain decoding (generation.generate_steps); so a chat's next turn is not prefilled again.
    prefix = model.prefix_cache if len(rows) == 1 else None
    batch = model.decoding.rows(runner, len(rows), min(length, config.max_positions), config.fill_token_id,
                                prefix=prefix)
    check_speculative(model, speculative)
    speculator = Speculator(batch, runner, speculative, drafter, stats)
    return _speculative_steps(batch, rows, states, speculator, config.fill_token_id)


def _speculative_steps(batch: RowBatch, prompts: Sequence[np.ndarray], states: Sequence[SequenceState],
                       speculator: Speculator, pad_token_id: int) -> Iterator[np.ndarray]:
    """Decode ``prompts`` (checked int64 [S_b]) on an empty ``batch`` with speculation (the
    ``DecodeLoop`` plain decoding and the server run); int64 [B] per step, as plain decoding
    yields them. Nothing runs until the first token is asked for."""
    added = [batch.add(prompt) for prompt in prompts]
    logits = np.stack([row_logits for _, row_logits in added])  # [B, V]
    yield from decode_rows(DecodeLoop(batch, speculator), [row for row, _ in added], logits, states,
                           prompts, pad_token_id)


def check_speculative(model, speculation: Speculation) -> None:
    """``ValueError`` for a target whose verified tokens can differ from plain decoding's while
    ``speculation.exact``."""
    quantization = model.manifest.quantization
    if speculation.exact and getattr(model, "batch_manifest", None) is not None:
        raise ValueError(
            "speculative: this model runs steps of many rows on its batch export (batch_export), "
            "so a verification step and a plain step can run on different weights and verified "
            "tokens can differ from plain decoding's. Speculate without a batch export, or accept "
            "inexact tokens: Speculation(..., exact=False), --speculative-inexact")
    if speculation.exact and quantization is not None:
        raise ValueError(
            f"speculative: this export's weights are quantised ({quantization.get('format', 'int')}); "
            "the int8 rounding of activations in ONNX Runtime's CPU kernels for them (MatMulNBits "
            "at accuracy level 4, w8a8) turns the few-ulp differences between a step of one token "
            "and a verified chunk into whole logits (SmolLM2-135M int4: 1.4 apart on an AVX2 CPU, "
            "1.25 on a VNNI one, against 4e-5 for float32; tfport bench --speculative measures "
            "it), so verified tokens can differ from plain greedy decoding. Speculate on a float "
            "export (a quantised export can be its draft), or accept inexact tokens: "
            "Speculation(..., exact=False), --speculative-inexact")


LOOKUP = "lookup"  # --speculative's name for prompt lookup; any other value is a draft export's directory


def names_draft_model(speculative: str | None) -> bool:
    """Whether ``--speculative``'s value (None: off) names a draft export, whose sessions take
    turns with the target's (so both should share one thread pool, ``SessionSettings.shared_threads``)."""
    return speculative is not None and speculative != LOOKUP


def open_drafter(speculative: str, target, argument: str, verify: str = "full"):
    """``--speculative``'s value -> ``LOOKUP``, or the draft export it names opened once with the
    ``target`` model's session settings; ``ValueError`` naming ``argument`` for anything else."""
    if speculative == LOOKUP:
        return LOOKUP
    if not Path(speculative).is_dir():
        raise ValueError(f"{argument}={speculative!r}: expected {LOOKUP!r} or the directory of a draft "
                         "decoder export")
    return type(target).load(speculative, settings=target.settings, verify=verify)


def drafter_for(speculative, model) -> Drafter:
    """The drafter ``speculative`` names: "lookup", a ``Drafter``, a draft ``Model`` or the
    directory of a draft export (opened with the target's session settings)."""
    Model = type(model)  # the target's class: this package is imported by the model module
    if isinstance(speculative, str) and speculative == LOOKUP:
        return PromptLookup()
    if isinstance(speculative, Model):
        return DraftModel(speculative, model.config.vocab_size)
    if isinstance(speculative, (str, os.PathLike)):
        if not Path(speculative).is_dir():
            raise ValueError(f"speculative={str(speculative)!r}: expected 'lookup' or the directory "
                             "of a draft decoder export")
        return DraftModel(Model.load(speculative, settings=model.settings), model.config.vocab_size)
    if hasattr(speculative, "start") and hasattr(speculative, "name"):
        return speculative
    raise TypeError(f"speculative={speculative!r}: expected 'lookup', a draft export's directory, "
                    "a Model or a Drafter")
