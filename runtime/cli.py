"""``tfport generate``, ``tfport chat`` and ``tfport embed``: run an export from the command line,
without torch.

    tfport generate DIR --ids 1,5,7 [--ids 1,9] --max-new-tokens 32 [--stream]
    tfport generate DIR --text "Once upon a time" --temperature 0.8 --top-p 0.9 --seed 0
    tfport chat DIR [--system "You are terse."] [--message "Hi!"]
    tfport chat DIR --message "Extract the person" --json-schema person.json   # also --regex, --grammar
    tfport embed DIR --text "a sentence" --pooling mean --normalize

Generated ids print one line per prompt (comma-separated; the text too when the export has a
tokenizer); embeddings print one JSON list per prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from tfport.flags import ascii_int, positive_int
from tfport.integrity import VERIFY_MODES

from .decoding.speculative import Speculation, SpeculationStats, names_draft_model, open_drafter
from .model import Model, load_model
from .request import LIBRARY, LIBRARY_CHAT
from .encoding import POOLINGS
from .session import PROVIDERS
from .tokenizer import TextStream, cut_at_stop

logger = logging.getLogger(__name__)

# Show a progress bar (stderr) when not streaming and generating at least this many tokens.
PROGRESS_MIN_TOKENS = 32
_ASCII_INT = re.compile(r"[+-]?[0-9]+")  # a token id as --ids takes it (int() also reads "１")


def parse_stop_ids(text: str) -> list[int]:
    """``--stop 128001,128009`` -> [128001, 128009] (as ``--ids``)."""
    try:
        return parse_ids(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(str(err).replace("--ids", "--stop")) from None


def parse_ids(text: str) -> list[int]:
    """``"1,2,3"`` (spaces around ids allowed) -> [1, 2, 3]; an empty entry (``1,,2``, a trailing
    comma), a space inside one (``1 2``) and what only Python's ``int`` reads as a number (the
    full-width ``１``, other scripts' digits, ``1_0``) are refused, not skipped, joined or read."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--ids: expected at least one token id")
    parts = [part.strip() for part in text.split(",")]
    if any(not part for part in parts):
        raise argparse.ArgumentTypeError(f"--ids {text!r}: an entry is empty; expected "
                                         "comma-separated integers such as 1,2,3")
    if not all(_ASCII_INT.fullmatch(part) for part in parts):
        raise argparse.ArgumentTypeError(f"--ids {text!r}: expected comma-separated integers "
                                         "(ASCII digits 0-9) such as 1,2,3")
    return [int(part) for part in parts]


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="DIR", help="directory written by 'tfport export'")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ids", type=parse_ids, action="append",
                        help="a prompt as comma-separated token ids (repeat for a batch)")
    source.add_argument("--text", action="append",
                        help="a prompt as text, needs the export's tokenizer.json (repeatable)")
    parser.add_argument("--provider", choices=PROVIDERS, default="cpu",
                        help="execution provider (default: cpu; auto tries CUDA)")
    parser.add_argument("--threads", type=ascii_int, default=0,
                        help="intra-op threads (default: one per usable CPU, spinning; "
                             "see tfport.runtime.threads)")
    _add_verify(parser)


def _add_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify", choices=VERIFY_MODES, default="full",
                        help="check the export's files against the sha256 in its manifest: full "
                             "(default), fast (files over 64 MiB by size only) or none")


def _add_speculative(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative", metavar="lookup|DRAFT_DIR", default=None,
                        help="decode speculatively: 'lookup' proposes from n-gram matches in the "
                             "prompt and output, DRAFT_DIR is a smaller decoder export with the "
                             "same vocabulary (same tokens when greedy; a summary on stderr)")
    parser.add_argument("--draft-tokens", type=positive_int, default=None, metavar="K",
                        help="most tokens proposed per step (default 8; adapted to the acceptance "
                             "rate and the measured cost of verifying)")
    parser.add_argument("--speculative-inexact", action="store_true",
                        help="speculate on a quantised export too, whose verified tokens can differ "
                             "from plain decoding's (its kernels round several rows differently)")


def _speculation(args: argparse.Namespace, model: Model) -> dict:
    """generate/chat keyword arguments for ``--speculative`` (a draft export opened once)."""
    if args.speculative is None:
        if args.draft_tokens is not None or args.speculative_inexact:
            raise ValueError("--draft-tokens, --speculative-inexact: apply with --speculative")
        return {}
    drafter = open_drafter(args.speculative, model, "--speculative", args.verify)
    return {"speculative": Speculation(drafter, exact=not args.speculative_inexact),
            "draft_tokens": args.draft_tokens, "speculation": SpeculationStats()}


def _add_penalties(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                        help="divide the positive logits of tokens already in the prompt or output "
                             "by R, multiply the negative ones (transformers; 1: off; default: the export's "
                             "generation_config.json, else 1)")
    parser.add_argument("--min-p", type=float, default=None, metavar="P",
                        help="when sampling, drop tokens less likely than P times the most likely "
                             "(0: off, the default)")


def _add_constraint(parser: argparse.ArgumentParser) -> None:
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", default=None,
                            help="structured output: the reply is JSON valid under the JSON schema "
                                 "in FILE (needs llguidance, extra 'text')")
    constraint.add_argument("--regex", default=None,
                            help="structured output: the reply matches this regular expression")
    constraint.add_argument("--grammar", metavar="FILE", default=None,
                            help="structured output: the reply follows the Lark grammar in FILE "
                                 "(llguidance's dialect; %%json {...} embeds a JSON schema)")


def _constraint(args: argparse.Namespace) -> dict:
    """generate/chat keyword arguments for ``--json-schema`` / ``--regex`` / ``--grammar``."""
    if args.regex is not None:
        return {"regex": args.regex}
    option, path = ("--json-schema", args.json_schema) if args.json_schema is not None else ("--grammar", args.grammar)
    if path is None:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{option} {path!r}: cannot read it ({err})") from None
    if option == "--grammar":
        return {"grammar": text}
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as err:
        raise ValueError(f"{option} {path!r}: not valid JSON ({err})") from None


def _report_speculation(options: dict) -> None:
    stats = options.get("speculation")
    if stats is not None:
        print(f"speculative: {stats.proposed} proposed, {stats.accepted} accepted "
              f"({stats.acceptance_rate:.0%}), {stats.tokens_per_forward:.2f} tokens per target "
              "forward", file=sys.stderr)


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``generate`` and ``embed``."""
    gen = subparsers.add_parser("generate",
                                help="continue prompts with a decoder or seq2seq export",
                                description="Greedy or sampled generation with ONNX Runtime.")
    _add_common(gen)
    gen.add_argument("--max-new-tokens", type=ascii_int, default=None,
                     help=f"new tokens per prompt (default {LIBRARY.max_new_tokens})")
    gen.add_argument("--temperature", type=float, default=None,
                     help="0 is greedy (default: the export's generation_config.json, else greedy)")
    gen.add_argument("--top-k", type=ascii_int, default=None,
                     help="keep the k most likely (0: all; default: generation_config.json, else 0)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="nucleus mass to keep (1: all; default: generation_config.json, else 1)")
    gen.add_argument("--seed", type=ascii_int, default=None, help="seed of the sampler")
    gen.add_argument("--stop", type=parse_stop_ids, default=None, metavar="ID[,ID]",
                     help="stop ids (default: every eos id of the export's generation_config.json, "
                          "else the config's eos_token_id)")
    gen.add_argument("--forced-bos", type=ascii_int, default=None, metavar="ID",
                     help="the first generated token of a seq2seq model, e.g. mBART-50's target "
                          "language code (default: the export's generation_config.json)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    _add_penalties(gen)
    _add_speculative(gen)
    _add_constraint(gen)
    gen.set_defaults(func=run_generate)

    chat = subparsers.add_parser(
        "chat", help="talk to an instruct export (its chat template), replies streamed",
        description="Multi-turn chat on stdin/stdout: one message per line, replies streamed; "
                    f"end with EOF (Ctrl-D) or {QUIT!r}. --message answers one message and exits.")
    chat.add_argument("model_dir", metavar="DIR", help="directory written by 'tfport export'")
    chat.add_argument("--system", help="system message opening the conversation")
    chat.add_argument("--message", help="answer this one message and exit (no prompt, no loop)")
    _add_speculative(chat)
    _add_constraint(chat)
    chat.add_argument("--max-new-tokens", type=positive_int, default=None,
                      help=f"per reply (default {LIBRARY_CHAT.max_new_tokens})")
    chat.add_argument("--temperature", type=float, default=None,
                      help="0 is greedy (default: the export's generation_config.json, else greedy)")
    chat.add_argument("--top-k", type=ascii_int, default=None,
                      help="keep the k most likely (0: all; default: generation_config.json, else 0)")
    chat.add_argument("--top-p", type=float, default=None,
                      help="nucleus mass to keep (1: all; default: generation_config.json, else 1)")
    chat.add_argument("--seed", type=ascii_int, default=None, help="seed of the sampler")
    _add_penalties(chat)
    chat.add_argument("--provider", choices=PROVIDERS, default="cpu",
                      help="execution provider (default: cpu; auto tries CUDA)")
    chat.add_argument("--threads", type=ascii_int, default=0,
                      help="intra-op threads (default: one per usable CPU, spinning; "
                             "see tfport.runtime.threads)")
    _add_verify(chat)
    chat.set_defaults(func=run_chat)

    emb = subparsers.add_parser("embed", help="sentence embeddings from an encoder export",
                                description="Pooled (and optionally normalised) encoder states.")
    _add_common(emb)
    emb.add_argument("--pooling", choices=POOLINGS, default=None,
                     help="default: the export's embedding.json (a sentence-transformers "
                          "checkpoint's pooling), else mean")
    emb.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                     help="scale to unit L2 norm (default: the export's embedding.json, else no)")
    emb.add_argument("--batch-size", type=positive_int, default=32, help="texts per encoder call (default 32)")
    emb.set_defaults(func=run_embed)


def _load(args: argparse.Namespace) -> Model:
    # A draft export takes turns with the target: one thread pool for both (threads.py).
    return load_model(args.model_dir, args.provider, intra_op_threads=args.threads, verify=args.verify,
                      shared_threads=names_draft_model(getattr(args, "speculative", None)))


def _open(args: argparse.Namespace) -> tuple[Model, list[list[int]]]:
    model = _load(args)
    logger.debug("%r: session providers %s", model, model.providers)
    if args.text is not None:
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError(f"--text: {args.model_dir} has no tokenizer.json; pass --ids")
        return model, tokenizer.encode_batch(args.text)
    return model, args.ids


def run_generate(args: argparse.Namespace) -> int:
    model, prompts = _open(args)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=args.stop,
                   forced_bos_token_id=args.forced_bos, repetition_penalty=args.repetition_penalty,
                   min_p=args.min_p, **_speculation(args, model),
                   **_constraint(args))
    text = args.text is not None
    if args.stream:
        if len(prompts) != 1:
            raise ValueError(f"--stream: expects one prompt, got {len(prompts)}")
        _stream(model, prompts, options, text)
        _report_speculation(options)
        return 0
    progress = (args.max_new_tokens or LIBRARY.max_new_tokens) >= PROGRESS_MIN_TOKENS
    tokens = model.generate(prompts, progress=progress, **options)
    _report_speculation(options)
    stops = model.stop_ids(args.stop)
    for row in tokens:
        kept = cut_at_stop(row, stops)
        if text:
            print(model.tokenizer.decode(kept))
        else:  # ids up to and including the stop id; the padding after it is dropped
            print(",".join(str(t) for t in [*kept, *row[len(kept):len(kept) + 1]]))
    return 0


def _stream(model: Model, prompts: list[list[int]], options: dict, text: bool) -> None:
    stops = model.stop_ids(options.get("stop_token_ids"))
    decoder = TextStream(model.tokenizer) if text else None
    count = 0
    for tokens in model.stream(prompts, **options):
        token = int(tokens[0])
        if decoder is not None:
            if token in stops:
                break
            sys.stdout.write(decoder.push(token))
        else:
            sys.stdout.write(("," if count else "") + str(token))
        count += 1
        sys.stdout.flush()
    if decoder is not None:
        sys.stdout.write(decoder.finish())
    sys.stdout.write("\n")


QUIT = "/quit"
USER_PROMPT = "> "


def _reply(model: Model, messages: list[dict], options: dict) -> str:
    """Stream the assistant's reply to stdout; return its text."""
    pieces = []
    for piece in model.chat_stream(messages, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
        pieces.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def run_chat(args: argparse.Namespace) -> int:
    from .chat import chat_format

    model = _load(args)
    model.runner("decoder", "chat")  # a decoder with a template and a tokenizer, before input is read
    chat_format(model)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   repetition_penalty=args.repetition_penalty, min_p=args.min_p,
                   **_speculation(args, model), **_constraint(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        _reply(model, [*messages, {"role": "user", "content": args.message}], options)
        _report_speculation(options)
        return 0
    try:
        _conversation(model, messages, options)
    finally:
        _report_speculation(options)
    return 0


def _conversation(model: Model, messages: list[dict], options: dict) -> None:
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write(USER_PROMPT)
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == QUIT:  # EOF or /quit
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        messages.append({"role": "assistant", "content": _reply(model, messages, options)})


def run_embed(args: argparse.Namespace) -> int:
    if args.text is not None:  # truncated as the checkpoint says, in batches
        model = _load(args)
        if model.tokenizer is None:
            raise ValueError(f"--text: {args.model_dir} has no tokenizer.json; pass --ids")
        embeddings = model.embed_text(args.text, pooling=args.pooling, normalize=args.normalize,
                                      batch_size=args.batch_size)
    else:
        model, prompts = _open(args)
        embeddings = model.embed(prompts, pooling=args.pooling, normalize=args.normalize)
    for row in embeddings:
        print(json.dumps([round(float(x), 6) for x in row]))
    return 0
