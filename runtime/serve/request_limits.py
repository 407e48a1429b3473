"""The size limits a served request must keep, checked before the work they bound:
``--max-prompt-chars`` on texts (before tokenising), ``--max-prompt-tokens`` on each tokenised
prompt or input (at most the context), ``--max-request-tokens`` on what a whole request takes
(prompts x n plus the tokens it may generate, or all of an embedding request's inputs). Each
refusal is an ``ApiError`` 400 naming the option and the limit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from .options import ServeOptions
from .errors import ApiError

# A completion prompt or an embedding input: a text, texts, token ids or token id lists.
Inputs = Union[str, list[str], list[int], list[list[int]]]


def text_lengths(inputs: Inputs, param: str) -> dict[str, int]:
    """Where each text of a prompt or an embedding input is (``param``, ``param[i]``) -> its
    length in characters."""
    if isinstance(inputs, str):
        return {param: len(inputs)}
    return {f"{param}[{index}]": len(text) for index, text in enumerate(inputs) if isinstance(text, str)}


class RequestLimits:
    """The checks of ``ServedModel`` (its ``options`` and ``context``: tokens a row may hold)."""

    options: ServeOptions
    context: int

    def limit_chars(self, lengths: dict[str, int], param: str) -> None:
        """``ApiError`` 400 naming ``--max-prompt-chars`` for a text over it: ``lengths`` maps
        where each text is (``prompt[1]``) to its length, known before anything tokenises it."""
        limit = self.options.max_prompt_chars
        for where, chars in lengths.items():
            if chars > limit:
                raise ApiError(400, f"{where}: {chars:,} characters, more than this server's "
                                    f"limit of {limit:,} per prompt (--max-prompt-chars)", param)

    def limit_prompt_tokens(self, rows: list[list[int]], param: str) -> None:
        """``ApiError`` 400 for a tokenised prompt over ``--max-prompt-tokens`` (default and at
        most the context)."""
        limit = min(self.options.max_prompt_tokens or self.context, self.context)
        for index, row in enumerate(rows):
            if len(row) > limit:
                where = param if len(rows) == 1 else f"{param}[{index}]"
                raise ApiError(400, f"{where}: {len(row):,} tokens, more than this server's limit of "
                                    f"{limit:,} per prompt (--max-prompt-tokens; the model's context "
                                    f"is {self.context:,})", param)

    def limit_request_tokens(self, tokens: int, what: str, param: str | None = None) -> None:
        """``ApiError`` 400 for a request taking more than ``--max-request-tokens`` tokens
        (``what`` says how they add up)."""
        limit = self.options.max_request_tokens
        if tokens > limit:
            raise ApiError(400, f"this request takes {tokens:,} tokens ({what}), more than this "
                                f"server's limit of {limit:,} per request (--max-request-tokens)",
                           param)

    def limit_generation(self, prompts: list[list[int]], n: int, max_tokens: int) -> None:
        """``--max-request-tokens`` for ``n`` sequences of each prompt, each up to ``max_tokens``
        new tokens."""
        prompt_tokens = sum(len(p) for p in prompts)
        sequences = len(prompts) * n
        self.limit_request_tokens(prompt_tokens * n + sequences * max_tokens,
                                  f"{prompt_tokens:,} prompt tokens x n={n} + {sequences} "
                                  f"sequence(s) x max_tokens={max_tokens:,}")

    def _limit_inputs(self, rows: Sequence[Sequence[int]]) -> int:
        """The tokens of tokenised embedding inputs, within ``--max-prompt-tokens`` each and
        ``--max-request-tokens`` together."""
        self.limit_prompt_tokens(rows, "input")
        tokens = sum(len(row) for row in rows)
        self.limit_request_tokens(tokens, f"{len(rows):,} inputs", "input")
        return tokens
