"""An exported model directory, opened with ONNX Runtime: generate, stream, encode, embed.

    >>> model = load_model("out/tiny-decoder", provider="cpu")
    >>> model.generate([[1, 5, 7], [1, 9]], max_new_tokens=8)       # int64 [2, <=8]
    >>> for tokens in model.stream([[1, 5, 7]], max_new_tokens=8):   # int64 [1] per step
    ...     print(tokens)

Prompts of different lengths are padded internally (left for decoders, right for encoders), so
each row of a batch gets its unbatched result.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tfport.config import ModelConfig
from tfport.contract import TOKENIZER_FILE
from tfport.embedding import EmbeddingSettings
from tfport.generation import GenerationDefaults
from tfport.manifest import Manifest

from .binding import GraphRunner
from .decoding import LayoutDecoding, decoding_for
from .decoding.engine import SequenceState
from .classify import Classification, classify
from .decoding.grammar import compile_constraint, with_response_format
from .decoding.prefix import DEFAULT_MB, PrefixCache
from .decoding.speculative import SpeculationStats, speculate
from .defaults import RequestDefaults, sequence_states
from .request import LIBRARY, Request, split_request
from .encoding import Encoder, EncoderOutput
from .generation import generate_steps
from .inputs import Prompts, check_length, check_vocab, pad_batch, split_prompts
from .sampling import Logprobs
from .batch_export import AUTO, use_batch_export
from .opening import open_export
from .session import SessionSettings
from .texts import EncodedTexts
from .tokenizer import TextTokenizer, cut_at_stop
from .tools import CallDelta, ChatReply

logger = logging.getLogger(__name__)

# callback(step, tokens int64 [B]) after each generated step.
StepCallback = Callable[[int, np.ndarray], None]


class Model:
    """The graphs of one export directory as ONNX Runtime sessions (see ``load_model``).

    ``prefix_cache``: a decoder's ``PrefixCache`` (``decoding.prefix``, 256 MiB): a single
    prompt (``chat`` over a conversation, ``generate`` with one prompt) starts from the keys and
    values of its longest prefix an earlier request computed, and keeps its own when it ends.
    Set it to None to turn that off, or to another ``PrefixCache`` to size it.
    """

    def __init__(self, directory: Path, manifest: Manifest, runners: dict[str, GraphRunner],
                 settings: SessionSettings):
        self.directory = directory
        self.manifest = manifest
        self.runners = runners
        self.settings = settings
        self._tokenizer: TextTokenizer | None = None
        # What a request leaves out: the checkpoint's stop ids, sampling defaults and forced
        # tokens (generation_config.json), else the config's and the library's.
        self.defaults = RequestDefaults(manifest.config, GenerationDefaults.read(directory))
        self.prefix_cache: PrefixCache | None = (PrefixCache.from_mb(DEFAULT_MB)
                                                 if manifest.config.family == "decoder" else None)
        self.batch_manifest: Manifest | None = None  # the batch export's, when ``load(batch_export=...)`` had one
        self.encoder = Encoder(functools.partial(self.runner, "encoder"), manifest.config,
                               EmbeddingSettings.read(directory), self.text_tokenizer)

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, model_dir: str | Path, provider: str = "cpu", *,
             settings: SessionSettings | None = None, verify: str = "full",
             batch_export: str | Path | None = None, batch_rows: int | str = AUTO) -> "Model":
        """Open ``model_dir`` (made by ``tfport export``) on ``provider`` (cpu, cuda, auto).

        ``settings`` overrides the session options (threads, graph optimisation level); its
        provider wins over ``provider``. ``verify`` checks the files against the sizes and sha256
        the manifest records before any session is opened: ``"full"`` hashes every file,
        ``"fast"`` only those up to 64 MiB (larger ones, the weights of a big model, are checked
        by size), ``"none"`` skips the check; what is skipped is logged as a warning. Each
        graph's settings fingerprint is checked against the manifest whatever ``verify`` says.
        An old export (manifest format 2) records neither, so it loads only with ``"none"``.
        Raises ``ValueError`` for a directory that is not an export, a file that does not match
        the manifest or a graph that cannot be loaded, ``RuntimeError`` if ``cuda`` is not usable.

        ``batch_export``: another export of the same model (same target, dtype and cache; e.g.
        ``--quantize w8a8`` beside an int4 one) that runs every graph run of at least
        ``batch_rows`` rows (batch x new tokens: batched decode steps, long prefills; "auto":
        measured here for a decoder, ``batch_export.use_batch_export``, about a second for
        SmolLM2-135M, not used where it is never faster; 8 for other families), opened with the
        same settings (``tfport serve``: one thread pool for both). int4's ``MatMulNBits`` costs
        about linearly in rows on CPUs without VNNI, w8a8's integer GEMM does not; each row's
        tokens then depend on how many rows its steps had (docs/serving.md).
        """
        if settings is not None and not isinstance(settings, SessionSettings):
            raise TypeError(f"settings: expected a SessionSettings or None, got "
                            f"{type(settings).__name__}")
        settings = settings if settings is not None else SessionSettings(provider=provider)
        directory, manifest, runners, settings = open_export(model_dir, settings, verify)
        model = cls(directory, manifest, runners, settings)
        use_batch_export(model, batch_export, batch_rows, verify)
        return model

    def __repr__(self) -> str:
        return (f"Model({str(self.directory)!r}, family={self.config.family!r}, "
                f"dtype={self.manifest.dtype!r}, device={self.device!r})")

    @property
    def config(self) -> ModelConfig:
        return self.manifest.config

    @property
    def providers(self) -> dict[str, list[str]]:
        """Graph name -> the execution providers its session really got."""
        return {name: runner.session.get_providers() for name, runner in self.runners.items()}

    @property
    def device(self) -> str:
        """``"cuda"`` or ``"cpu"``: where the sessions run and the KV cache lives."""
        return next(iter(self.runners.values())).device

    @property
    def tokenizer(self) -> TextTokenizer | None:
        """The export's tokenizer (``manifest.tokenizer`` or ``tokenizer.json``), or None."""
        if self._tokenizer is None:
            name = self.manifest.tokenizer or TOKENIZER_FILE
            path = self.directory / name
            if self.manifest.tokenizer is None and not path.is_file():
                return None
            self._tokenizer = TextTokenizer(path)
        return self._tokenizer

    @property
    def generation(self) -> GenerationDefaults | None:
        """The export's generation_config.json (stop ids, sampling, forced tokens), or None."""
        return self.defaults.generation

    @generation.setter
    def generation(self, generation: GenerationDefaults | None) -> None:
        self.defaults = RequestDefaults(self.config, generation)

    @property
    def decoding(self) -> LayoutDecoding:
        """The runtime side of the decoder's cache layout (``decoding.LayoutDecoding``)."""
        return decoding_for(self.manifest.layout)

    def runner(self, graph: str, method: str) -> GraphRunner:
        """The session of ``graph`` ("encoder", "decoder", "classifier"); ``ValueError`` naming
        ``method`` when this export has no such graph."""
        if graph not in self.runners:
            raise ValueError(f"{method}: model family {self.config.family!r} has no {graph} graph "
                             f"(it has {sorted(self.runners)})")
        return self.runners[graph]

    def text_tokenizer(self, argument: str) -> TextTokenizer:
        """The export's tokenizer; ``ValueError`` naming ``argument`` when it has none."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{argument}: this export has no {TOKENIZER_FILE}; pass token ids "
                             "or export with a tokenizer")
        return tokenizer

    # -------------------------------------------------------------------------------- generation
    def stream(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
               request: Request | None = None, *, logprobs: Logprobs | None = None,
               speculation: SpeculationStats | None = None, **options: Any) -> Iterator[np.ndarray]:
        """Tokens int64 [B] per step, as they are produced (see ``generate`` for arguments).

        Arguments are checked now, before the first token is asked for.
        """
        return self._steps(input_ids, attention_mask, Request.of(request, **options), logprobs,
                           speculation)[0]

    def _steps(self, input_ids: Prompts, attention_mask: np.ndarray | None, request: Request,
               logprobs: Logprobs | None, speculation: SpeculationStats | None
               ) -> tuple[Iterator[np.ndarray], int]:
        """``request`` resolved for these prompts -> (its steps, the new tokens asked per row)."""
        runner = self.runner("decoder", "generate")
        config = self.config
        if logprobs is not None:
            if not isinstance(logprobs, Logprobs):
                raise TypeError(f"logprobs={logprobs!r}: expected a tfport.runtime.sampling.Logprobs "
                                "(e.g. Logprobs(top=5)), which collects them, or None")
            request = request.replace(top_logprobs=logprobs.top)
        params = request.params(self.defaults)
        stops = request.stop_ids(self.defaults)
        rows = split_prompts(input_ids, attention_mask)
        check_vocab(rows, config.vocab_size)
        longest = max(len(row) for row in rows)
        check_length("input_ids", longest, config.max_positions, "the longest prompt")
        max_new_tokens = request.token_budget(longest, config.max_positions,
                                              seq2seq=config.family == "encoder-decoder")
        first, static = self._first_decoder_inputs(rows)
        forced = request.forced(self.defaults, max_new_tokens,
                                one_token_start=max(len(row) for row in first) == 1)
        states = sequence_states(len(first), params, request.seed, max_new_tokens, stops, forced,
                                 prompts=first, vocab_size=config.vocab_size, logprobs=request.top_logprobs)
        if logprobs is not None:
            logprobs.rows = [state.token_logprobs for state in states]  # filled as rows decode
        self._constrain(states, request)
        if request.speculative is not None:
            steps = speculate(self, first, states, request.speculative, request.draft_tokens, speculation)
        else:
            steps = generate_steps(self.decoding.strategy, runner, first, states, config.fill_token_id,
                                   static, self.prefix_cache)
        return steps, max_new_tokens

    def _constrain(self, states: Sequence[SequenceState], request: Request) -> None:
        """Give each row its own processor of the request's constraint, if any
        (``decoding.grammar``): it allows only output that the ``json_schema`` / ``regex`` /
        ``grammar`` accepts, and ends the row at its stop ids once the output is complete."""
        constraint = request.constraint
        if not constraint:
            return
        compiled = compile_constraint(self.text_tokenizer(next(iter(constraint))), self.config.vocab_size,
                                      **constraint)
        for state in states:
            state.processors = (*state.processors, compiled.processor(state.stop_ids))

    def sampling(self, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None) -> dict:
        """The sampling arguments ``generate`` uses (``Request.sampling``)."""
        return Request(temperature=temperature, top_k=top_k, top_p=top_p).sampling(self.defaults)

    def stop_ids(self, stop_token_ids: Sequence[int] | None = None) -> tuple[int, ...]:
        """The stop ids ``generate`` uses (``Request.stop_ids``)."""
        return Request(stop_token_ids=stop_token_ids).stop_ids(self.defaults)

    def forced_tokens(self, forced_bos_token_id: int | tuple[()] | None = None,
                      forced_eos_token_id: int | Sequence[int] | None = None,
                      max_new_tokens: int = LIBRARY.max_new_tokens,
                      one_token_start: bool = True) -> dict[int, tuple[int, ...]]:
        """The steps ``generate`` forces -> the ids allowed there (``Request.forced``)."""
        return Request(forced_bos_token_id=forced_bos_token_id, forced_eos_token_id=forced_eos_token_id
                       ).forced(self.defaults, max_new_tokens, one_token_start)

    def _first_decoder_inputs(self, rows: list[np.ndarray]) -> tuple[list[np.ndarray], dict]:
        """Checked prompts -> the first decoder call's rows and the per-request static inputs:
        the prompts for decoders; for seq2seq the decoder start token per row, with the encoder
        run once for the cross-attention K/V."""
        config = self.config
        if config.family == "encoder-decoder":
            encoder_ids, encoder_mask = pad_batch(rows, config.fill_token_id, "right")
            static = self._cross_attention(encoder_ids, encoder_mask)
            start = np.array([config.decoder_start_token_id], dtype=np.int64)
            return [start] * len(rows), static
        return rows, {}

    def generate(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
                 request: Request | None = None, *, logprobs: Logprobs | None = None,
                 speculation: SpeculationStats | None = None, callback: StepCallback | None = None,
                 progress: bool = False, **options: Any) -> np.ndarray:
        """Continue prompts -> generated tokens int64 [B, N], N <= max_new_tokens.

        ``input_ids``: ragged id lists, or int array [B, S] with an optional 0/1
        ``attention_mask`` [B, S] (padding on either side). For encoder-decoder models the
        prompts are the encoder input and decoding starts from ``decoder_start_token_id``.

        What to decode is a ``request`` (``tfport.runtime.Request``: its docstring says each
        field), its fields given as keyword arguments, or both (the keywords win):
        ``max_new_tokens`` (default 16), ``stop_token_ids`` (default: every eos id of the export's
        generation_config.json, else the config's; ``()`` never stops early), ``temperature`` (0
        greedy), ``top_k``, ``top_p``, ``min_p``, ``seed``, the penalties and ``logit_bias`` (as
        OpenAI / transformers / vLLM define them, ``tfport.runtime.sampling``), forced tokens,
        ``json_schema`` / ``regex`` / ``grammar`` (structured output, ``decoding.grammar``) and
        ``speculative`` / ``draft_tokens`` (``decoding.speculative``; greedy tokens are plain
        decoding's, sampled ones follow the same distribution). A field left at None takes the
        export's generation_config.json, else greedy / none. Generation ends when every row has
        produced a stop id; finished rows continue with ``config.fill_token_id``.

        Collected besides the tokens: ``logprobs`` (a ``Logprobs``: each token's log-probability
        under the model, before penalties and temperature, and its ``top`` alternatives'),
        ``speculation`` (a ``SpeculationStats``). ``callback(step, tokens [B])`` runs after each
        step; ``progress`` shows a tqdm bar on stderr.
        """
        if callback is not None and not callable(callback):
            raise TypeError(f"callback={callback!r}: expected a function callback(step, tokens) "
                            "or None")
        if not isinstance(progress, (bool, np.bool_)):
            raise TypeError(f"progress={progress!r}: expected true or false")
        steps, max_new_tokens = self._steps(input_ids, attention_mask, Request.of(request, **options),
                                            logprobs, speculation)
        tokens = []
        with tqdm(total=max_new_tokens, desc="generate", unit="tok", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            for step, token in enumerate(steps):
                tokens.append(token)
                if callback is not None:
                    callback(step, token)
                bar.update(1)
        return np.stack(tokens, axis=1)

    # ------------------------------------------------------------------------------------ text
    def generate_text(self, prompts: str | Sequence[str], request: Request | None = None,
                      **kwargs: Any) -> str | list[str]:
        """Generate from text prompt(s) -> the continuation text(s) (one per prompt), stopped
        before the first stop token; ``request`` and keyword arguments as ``generate``'s."""
        tokenizer = self.text_tokenizer("prompts")
        options, rest = split_request(kwargs)
        request = Request.of(request, **options)
        tokens = self.generate(tokenizer.encode_batch(prompts, "prompts"), None, request, **rest)
        texts = [tokenizer.decode(cut_at_stop(row, request.stop_ids(self.defaults))) for row in tokens]
        return texts[0] if isinstance(prompts, str) else texts

    def chat(self, messages: Sequence[dict], **kwargs: Any) -> str | ChatReply:
        """The assistant's reply to ``messages`` (``[{"role": "user", "content": "..."}, ...]``),
        rendered with the export's chat template and stopped at its end-of-turn token.
        Keyword arguments: ``generate``'s (``max_new_tokens`` default 256), OpenAI's
        ``response_format``, and ``tools``, ``tool_choice``, ``parallel_tool_calls`` (then the
        reply is a ``ChatReply``: ``content``, ``tool_calls``); see ``tfport.runtime.chat``."""
        from .chat import chat
        return chat(self, messages, **with_response_format(kwargs))

    def chat_stream(self, messages: Sequence[dict], **kwargs: Any) -> Iterator[str | CallDelta]:
        """``chat``, streamed: one text piece per generated token (see ``tfport.runtime.chat``);
        with ``tools``, calls come as ``tools.CallDelta`` items."""
        from .chat import chat_stream
        return chat_stream(self, messages, **with_response_format(kwargs))

    # -------------------------------------------------------------------------------- encoders
    @property
    def embedding(self) -> EmbeddingSettings | None:
        """The export's sentence-embedding pipeline (``embedding.json``), or None."""
        return self.encoder.embedding

    def encode(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
               token_type_ids: Prompts | None = None) -> EncoderOutput:
        """Per-token states of the encoder -> ``EncoderOutput`` (``Encoder.encode``)."""
        return self.encoder.encode(input_ids, attention_mask, token_type_ids)

    def embed(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
              token_type_ids: Prompts | None = None, **options: Any) -> np.ndarray:
        """Sentence embeddings float32 [B, E] of token ids (``Encoder.embed``: ``pooling``,
        ``normalize``)."""
        return self.encoder.embed(input_ids, attention_mask, token_type_ids, **options)

    def embed_text(self, texts: str | Sequence[str], **options: Any) -> np.ndarray:
        """Sentence embeddings float32 [B, E] of text(s), as ``SentenceTransformer.encode`` gives
        them (``Encoder.embed_text``: ``pooling``, ``normalize``, ``batch_size``, ``progress``)."""
        return self.encoder.embed_text(texts, **options)

    def encode_texts(self, texts: str | Sequence[str], pairs: str | Sequence[str] | None = None,
                     method: str = "encode_texts") -> EncodedTexts:
        """Token ids of texts (or text pairs), truncated (``Encoder.encode_texts``)."""
        return self.encoder.encode_texts(texts, pairs, method)

    def embed_encoded(self, encoded: EncodedTexts, **options: Any) -> np.ndarray:
        """``embed_text`` of texts ``encode_texts`` encoded (``Encoder.embed_encoded``)."""
        return self.encoder.embed_encoded(encoded, **options)

    def matryoshka(self, vectors: np.ndarray, dimensions: int) -> np.ndarray:
        """The first ``dimensions`` of each embedding (``Encoder.matryoshka``)."""
        return self.encoder.matryoshka(vectors, dimensions)

    def text_limit(self) -> tuple[int, str]:
        """(tokens, why): the length texts are truncated to (``Encoder.text_limit``)."""
        return self.encoder.text_limit()

    def classify(self, texts: str | Sequence[str], pairs: str | Sequence[str] | None = None,
                 **options: Any) -> Classification:
        """Sequence classification of text(s), or of (text, pair) rows for rerankers and
        cross-encoders -> ``Classification`` (``tfport.runtime.classify``: ``batch_size``,
        ``progress``)."""
        return classify(self, texts, pairs, **options)

    def _cross_attention(self, ids: np.ndarray, mask: np.ndarray) -> dict:
        """Run encoder.onnx once -> the decoder's static inputs: ``encoder_attention_mask``
        [B, Senc] and ``past_key_values.{i}.encoder.key|value`` [B, Hkv, Senc, D] (OrtValues
        on the session's device)."""
        runner = self.runners["encoder"]
        names = [t.name for t in runner.spec.outputs if t.name.startswith("present.")]
        outputs = runner.run({"input_ids": ids, "attention_mask": mask}, device_outputs=names)
        static: dict = {"encoder_attention_mask": mask}
        static.update({"past_key_values." + n[len("present."):]: outputs[n] for n in names})
        return static


def load_model(model_dir: str | Path, provider: str = "cpu", *, intra_op_threads: int = 0,
               inter_op_threads: int = 0, graph_optimization: str = "all",
               device_id: int = 0, verify: str = "full", shared_threads: bool = False,
               batch_export: str | Path | None = None, batch_rows: int | str = AUTO) -> Model:
    """Open an export directory; see ``Model.load`` (``verify``, ``batch_export``) and
    ``SessionSettings``."""
    settings = SessionSettings(provider=provider, device_id=device_id,
                               intra_op_threads=intra_op_threads,
                               inter_op_threads=inter_op_threads,
                               graph_optimization=graph_optimization, shared_threads=shared_threads)
    return Model.load(model_dir, settings=settings, verify=verify, batch_export=batch_export, batch_rows=batch_rows)
