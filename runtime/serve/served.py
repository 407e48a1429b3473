"""The models one server holds, and how an API request becomes library calls.

A ``ServedModel`` is one export directory: its ``Model``, its continuous-batching ``Scheduler``
(decoders), ``seq2seq.Seq2SeqScheduler`` (encoder-decoders) or embedding ``batcher`` (encoders),
and the conversions from request fields to the library's arguments. What the model computes is
decided by the library alone, as for ``tfport generate`` / ``chat`` / ``embed``: sampling
defaults by ``Model.sampling`` (request > generation_config.json > greedy), stop ids by
``Model.stop_ids``, chat prompts and end-of-turn ids by ``tfport.runtime.chat``, forced tokens by
the scheduler (``Model.forced_tokens``), embeddings by ``Model.embed_encoded`` of the inputs as
``Model.encode_texts`` encodes texts (the export's truncation, lower-casing, pooling and
normalisation) or of token ids as sent (the export's pooling and normalisation).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..chat import chat_format
from ..decoding.grammar import Constraint, compile_constraint
from ..decoding.prefix import PrefixCache
from ..decoding.speculative import LOOKUP, Speculation, names_draft_model, open_drafter
from ..request import CHAT, COMPLETIONS, ApiDefaults, Request
from ..model import Model
from ..sampling import TokenLogprob, token_logprobs
from ..session import SessionSettings
from ..texts import EncodedTexts
from ..tokenizer import TextStream, TextTokenizer
from ..tools import ToolRequest
from .batcher import EmbeddingBatcher
from .options import ServeOptions
from .request_limits import Inputs, RequestLimits, text_lengths
from .errors import ApiError, check_text, quote
from .protocol import ChatRequest, CompletionRequest, DecodingRequest
from .handles import GenerationRequest, Handle, QueueFull, finished
from .request_queue import Stopped
from .scheduler import Scheduler
from .seq2seq import Seq2SeqScheduler, refuse_for_seq2seq

class ServedModel(RequestLimits):
    """One export behind the server: ``name`` is its id in the API."""

    def __init__(self, name: str, model: Model, options: ServeOptions, observer=None):
        self.name = name
        self.model = model
        self.options = options
        self.family = model.config.family
        self.scheduler: Scheduler | Seq2SeqScheduler | None = None
        if self.family == "encoder-decoder" and "decoder" in model.runners:  # not a classifier
            self.scheduler = Seq2SeqScheduler(model, options.limits, observer)
        if self.family == "decoder":
            model.prefix_cache = PrefixCache.from_mb(options.prefix_cache_mb)  # the library's too
            self.scheduler = Scheduler(model, options.limits, observer, self._speculation(),
                                       model.prefix_cache)
        self.batcher: EmbeddingBatcher | None = None
        if self.family == "encoder":
            self.batcher = EmbeddingBatcher(functools.partial(model.embed_encoded, progress=False),
                                            options.embedding_batch_ms / 1000, options.embedding_batch_tokens)

    def _speculation(self) -> Speculation | None:
        """The scheduler's speculation from the options (a draft export opened once, with the
        target's session settings)."""
        if self.options.speculative is None:
            return None
        drafter = open_drafter(self.options.speculative, self.model, "speculative")
        if drafter != LOOKUP:
            drafter.prefix_cache = PrefixCache.from_mb(self.options.prefix_cache_mb)  # the target's budget
        return Speculation(drafter, self.options.draft_tokens, exact=not self.options.speculative_inexact)

    @functools.cached_property
    def chats(self) -> bool:
        """Whether /v1/chat/completions can render this export's prompts (a decoder with a chat
        template and a tokenizer, as ``tfport.runtime.chat`` finds them)."""
        if self.family != "decoder":
            return False
        try:
            chat_format(self.model)
        except (ValueError, ImportError):
            return False
        return True

    @property
    def speculates(self) -> bool:
        return self.scheduler is not None and self.scheduler.speculation is not None

    @classmethod
    def load(cls, directory: str | Path, options: ServeOptions, name: str | None = None,
             observer_for=None) -> "ServedModel":
        # Sessions that take turns share one thread pool: a target and its draft, an export and
        # its batch export (each pool would spin on the cores the other's next run needs).
        turns = names_draft_model(options.speculative) or options.batch_export is not None
        settings = SessionSettings(provider=options.provider, intra_op_threads=options.threads,
                                   shared_threads=turns)
        model = Model.load(directory, settings=settings, batch_export=options.batch_export,
                           batch_rows=options.batch_rows)
        name = name or Path(directory).resolve().name
        return cls(name, model, options, observer_for(name) if observer_for else None)

    def start(self) -> None:
        if self.scheduler is not None:
            self.scheduler.start()

    def end_requests(self) -> None:
        """End the scheduler's waiting and running requests now (``Scheduler.end_now``)."""
        if self.scheduler is not None:
            self.scheduler.end_now()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()

    def health(self) -> dict:
        """``family``; for a decoder also its ``running`` and ``waiting`` rows and whether its
        scheduler thread is ``alive``."""
        if self.scheduler is None:
            return {"family": self.family}
        return {"family": self.family, "running": self.scheduler.running,
                "waiting": self.scheduler.waiting, "alive": self.scheduler.alive}

    def require(self, families: str | tuple[str, ...], endpoint: str) -> None:
        """``ApiError`` 400 naming ``model`` unless this export is of one of ``families``
        (encoder-decoder generation: one with a decoder graph, not a classifier)."""
        families = (families,) if isinstance(families, str) else families
        generates = self.family != "encoder-decoder" or self.scheduler is not None
        if self.family not in families or not generates:
            kind = " or ".join(f"{'an' if f[0] == 'e' else 'a'} {f}" for f in families)
            what = f"{self.family} classifier" if not generates else self.family
            raise ApiError(400, f"model {self.name!r} is {'an' if what[0] == 'e' else 'a'} {what} "
                                f"export; {endpoint} needs {kind} export", "model")

    # --------------------------------------------------------------------------------- limits
    @property
    def context(self) -> int:
        """Tokens a row may hold: the scheduler's ``max_length`` (decoders), else the model's
        ``max_positions``."""
        return self.model.config.max_positions if self.scheduler is None else self.scheduler.max_length

    # ------------------------------------------------------------------------------ token ids
    def _tokenizer(self, param: str) -> TextTokenizer:
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ApiError(400, f"{param}: model {self.name!r} has no tokenizer.json; send token ids "
                                "instead of text", param)
        return tokenizer

    def prompts(self, prompt: Inputs, param: str = "prompt") -> list[list[int]]:
        """A completion prompt / embedding input -> token id lists: a str, a list of str, a list
        of ids or a list of id lists."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, f"{param}: expected at least one prompt", param)
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        rows = []
        for index, item in enumerate(prompt):
            if isinstance(item, str):
                item = self._tokenizer(param).encode(item)
            if not item:
                raise ApiError(400, f"{param}[{index}]: empty; expected at least one token", param)
            rows.append([int(t) for t in item])
        vocab = self.model.config.vocab_size
        for index, row in enumerate(rows):
            bad = [t for t in row if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{param}[{index}]: token ids {quote(bad)} outside [0, {vocab})",
                               param)
        return rows

    def chat(self, messages: list[dict], tools: list[dict] | None = None
             ) -> tuple[list[int], tuple[int, ...]]:
        """Prompt ids of ``messages`` (and ``tools``) rendered with the export's chat template,
        and the ids that end the assistant's turn (``tfport.runtime.chat``, as ``Model.chat``
        takes them)."""
        try:
            fmt = chat_format(self.model)
            return fmt.prompt_ids(messages, **({"tools": tools} if tools else {})), fmt.stop_ids
        except (ValueError, TypeError) as err:
            raise ApiError(400, str(err), "messages") from None

    def tool_request(self, body: ChatRequest) -> ToolRequest:
        """What the chat's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask of this
        export's template (``ChatFormat.tool_request``: the tools to render, the call format to
        parse, the grammar forcing a call); ``ApiError`` 400 naming the malformed field."""
        if body.tools is None and body.tool_choice is None:
            return ToolRequest()
        try:
            return chat_format(self.model).tool_request(body.tools, body.tool_choice,
                                                        body.parallel_tool_calls)
        except ValueError as err:
            message = str(err)
            param = next((p for p in ("tool_choice", "parallel_tool_calls") if message.startswith(p)),
                         "tools")
            raise ApiError(400, message, param) from None

    def text_stream(self) -> TextStream | None:
        tokenizer = self.model.tokenizer
        return None if tokenizer is None else TextStream(tokenizer)

    # ----------------------------------------------------------------------------- generation
    def stop_ids(self, ignore_eos: bool, extra: Sequence[int] | None,
                 defaults: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The ids that end a row: ``defaults`` (None: ``Model.stop_ids``'s, those of
        ``Model.generate``) unless ``ignore_eos``, plus the request's ``stop_token_ids``."""
        ids = () if ignore_eos else (self.model.stop_ids() if defaults is None else defaults)
        if extra:
            try:
                extra = self.model.stop_ids(extra)
            except (ValueError, TypeError) as err:
                raise ApiError(400, str(err), "stop_token_ids") from None
            ids = tuple(dict.fromkeys([*ids, *extra]))
        return ids

    def decoding(self, body: DecodingRequest, prompts: list[list[int]], prompt_param: str,
                 api: ApiDefaults, stop_ids: tuple[int, ...]) -> Request:
        """``body`` as a ``Request`` with what it leaves out resolved, as ``Model.generate``
        resolves its own (``request.Request``): the new tokens per row (``None`` for an echo that
        generates nothing; else ``max_new_tokens`` within this server's ``--max-tokens`` and the
        context left after the longest prompt), ``stop_ids`` and the sampling (the export's
        generation_config.json where it samples, else ``api``'s: OpenAI's temperature 1).
        ``ApiError`` 400 naming the field the client sent."""
        request = body.request()
        self.limit_prompt_tokens(prompts, prompt_param)
        asked, param = body.token_budget()
        tokens = None
        if asked != 0:  # 0: a completion's echo only (CompletionRequest)
            try:
                tokens = request.token_budget(max(len(p) for p in prompts), self.context,
                                              seq2seq=self.family == "encoder-decoder", api=api,
                                              cap=self.options.max_tokens, argument=param)
            except ValueError as err:
                raise ApiError(400, str(err), param) from None
        try:
            return request.replace(max_new_tokens=tokens, stop_token_ids=stop_ids,
                                   **request.sampling(self.model.defaults, api))
        except ValueError as err:
            raise ApiError.refusal(str(err)) from None

    def prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability after the tokens before it and its ``top``
        alternatives (None for the first: nothing precedes it), from one forward over the
        prompt (the export's decoder returning every position's logits), reduced piece by piece.
        Runs the decoder: call it in a worker thread."""
        found: list[TokenLogprob | None] = [None]
        for logits in self.model.decoding.score(self.model.runner("decoder", "echo"),
                                                np.asarray(prompt, dtype=np.int64)[None]):  # [s, V]
            # position i predicts token i + 1: the prompt's last position predicts nothing
            found += token_logprobs(logits, prompt[len(found):len(found) + len(logits)], top)
        return found

    def completion_inputs(self, body: CompletionRequest) -> tuple[list[list[int]], Request]:
        """A completion request -> (prompt ids, its ``decoding``); ``ApiError`` 400 for a
        request that cannot run. Tokenises: call it in a worker thread."""
        self.limit_chars(text_lengths(body.prompt, "prompt"), "prompt")
        check_text(body, "")
        body.refuse_unsupported()
        if self.family == "encoder-decoder":
            refuse_for_seq2seq(body)
        self.constraint(body)  # compiled here, off the event loop; submit finds it cached
        prompts = self.prompts(body.prompt)
        request = self.decoding(body, prompts, "prompt", COMPLETIONS,
                                self.stop_ids(body.ignore_eos, body.stop_token_ids))
        self.limit_generation(prompts, body.n, request.max_new_tokens or 0)
        return prompts, request

    def chat_inputs(self, body: ChatRequest) -> tuple[list[list[int]], Request]:
        """A chat request -> ([prompt ids], its ``decoding``): the messages rendered with the
        export's template, stops at its end of turn. Tokenises: call it in a worker thread."""
        if len(body.messages) > self.options.max_messages:
            raise ApiError(400, f"messages: {len(body.messages):,} messages, more than this "
                                f"server's limit of {self.options.max_messages:,} per chat "
                                "(--max-messages)", "messages")
        texts = [m.text(i) for i, m in enumerate(body.messages)]
        self.limit_chars({"messages": sum(map(len, texts))}, "messages")
        check_text(body, "")
        body.refuse_unsupported()
        self.constraint(body)  # compiled here, off the event loop; submit finds it cached
        messages = [{**m.model_dump(exclude_none=True), "content": text}
                    for m, text in zip(body.messages, texts)]
        prompt, turn_ends = self.chat(messages, self.tool_request(body).tools)
        request = self.decoding(body, [prompt], "messages", CHAT,
                                self.stop_ids(body.ignore_eos, body.stop_token_ids, turn_ends))
        self.limit_generation([prompt], body.n, request.max_new_tokens)
        return [prompt], request

    def submit(self, prompts: list[list[int]], body: DecodingRequest, request: Request,
               loop: asyncio.AbstractEventLoop) -> list[Handle]:
        """Queue ``body.n`` sequences per prompt (each its own seed, ``seed + i``) decoding
        ``request`` (``decoding``'s) -> handles delivering to ``loop``; ``ApiError`` 400 for a
        request that cannot run, 429 when the queue is full, 503 once the scheduler is stopped."""
        try:
            params = request.params(self.model.defaults)
        except ValueError as err:
            raise ApiError.refusal(str(err)) from None
        count = len(prompts) * body.n
        if count > self.options.max_queue:
            raise ApiError(400, f"n: {len(prompts)} prompt(s) x n={body.n} = {count} sequences, more "
                                f"than this server's queue of {self.options.max_queue}", "n")
        rows = [prompt for prompt in prompts for _ in range(body.n)]
        if request.max_new_tokens is None:  # echo only (CompletionRequest): nothing to generate
            return [finished(GenerationRequest(prompt, 0), "length", loop) for prompt in rows]
        stop_ids, seed = request.stop_token_ids, request.seed
        requests = [GenerationRequest(prompt, request.max_new_tokens, params,
                                      None if seed is None else seed + index, stop_ids,
                                      self.options.timeout, request.top_logprobs)
                    for index, prompt in enumerate(rows)]
        constraint = self.constraint(body)
        if constraint is not None:  # one processor per row: each holds its row's grammar state
            if not stop_ids:
                raise ApiError(400, "response_format: a constrained row ends at a stop token once its "
                                    "output is complete, and ignore_eos leaves it none", "response_format")
            for request in requests:
                request.processors = (constraint.processor(stop_ids),)
        try:
            return self.scheduler.submit(requests, loop=loop)
        except QueueFull as err:
            raise ApiError(429, str(err), code="queue_full") from None
        except Stopped as err:
            raise ApiError(503, str(err), code="shutting_down") from None
        except ValueError as err:
            raise ApiError(400, str(err), "prompt") from None

    def constraint(self, body: DecodingRequest) -> Constraint | None:
        """``body.response_format`` compiled for this export (None for text): the first call
        compiles (``chat_inputs`` / ``completion_inputs``, in a worker thread), later ones hit
        ``decoding.grammar``'s cache. ``ApiError`` 400 with param ``response_format`` when it is
        malformed or cannot be served (no tokenizer, no llguidance)."""
        arguments, param = body.constraint(), "response_format"
        tools = self.tool_request(body) if isinstance(body, ChatRequest) else ToolRequest()
        if tools.grammar is not None:  # tool_choice "required" or a named function
            if arguments:
                raise ApiError(400, f"tool_choice={quote(body.tool_choice)}: forces a tool call by "
                                    "grammar; it takes no response_format too", "tool_choice")
            arguments, param = {"grammar": tools.grammar}, "tools"
        if not arguments:
            return None
        try:
            return compile_constraint(self._tokenizer(param), self.model.config.vocab_size, **arguments)
        except (ValueError, TypeError, ImportError) as err:
            raise ApiError(400, f"{param}: {err}", param) from None

    # ----------------------------------------------------------------------------- embeddings
    def embedding_inputs(self, inputs: Inputs) -> EncodedTexts:
        """An embedding ``input`` checked and tokenised: texts as ``Model.embed_text`` encodes
        them (the export's truncation and lower-casing), token ids as sent (segment 0). Tokenises:
        call it in a worker thread; ``batcher.embed`` then embeds the rows with the export's
        pooling and normalisation (``tfport embed``)."""
        count = 1 if isinstance(inputs, str) or all(isinstance(t, int) for t in inputs) else len(inputs)
        if count > self.options.max_inputs:
            raise ApiError(400, f"input: {count:,} inputs, more than this server's limit of "
                                f"{self.options.max_inputs:,} per request (--max-embedding-inputs)",
                           "input")
        self.limit_chars(text_lengths(inputs, "input"), "input")
        texts = [inputs] if isinstance(inputs, str) else inputs
        try:
            if texts and all(isinstance(t, str) for t in texts):
                self._tokenizer("input")
                encoded = self.model.encode_texts(texts, method="embeddings")
            else:
                rows = self.prompts(inputs, "input")
                encoded = EncodedTexts(rows, [[0] * len(row) for row in rows], [False] * len(rows))
        except (ValueError, TypeError) as err:
            raise ApiError(400, f"input: {err}", "input") from None
        self._limit_inputs(encoded.ids)
        return encoded
