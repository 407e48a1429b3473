"""``tfport classify``: logits, scores and the label of each text or text pair of a sequence
classification export, one JSON object per line (``classify``)."""

from __future__ import annotations

import argparse
import json

from .model import load_model
from .session import PROVIDERS
from .texts import BATCH_SIZE


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``classify``."""
    p = subparsers.add_parser(
        "classify", help="classify texts or score text pairs with a sequence classification export",
        description="Logits, scores and the label of each text (or --text/--pair row: rerankers, "
                    "cross-encoders), one JSON object per line.")
    p.add_argument("model_dir", metavar="DIR", help="directory written by 'tfport export'")
    p.add_argument("--text", action="append", required=True, help="a text (repeatable)")
    p.add_argument("--pair", action="append",
                   help="its pair (repeatable: one per --text, one for all texts, or several for "
                        "one --text: a premise against hypotheses)")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="rows per encoder call (default 32)")
    p.add_argument("--provider", choices=PROVIDERS, default="cpu",
                   help="execution provider (default: cpu; auto tries CUDA)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: ONNX Runtime's choice)")
    p.set_defaults(func=run_classify)


def run_classify(args: argparse.Namespace) -> int:
    model = load_model(args.model_dir, args.provider, intra_op_threads=args.threads)
    texts, pairs = args.text, args.pair
    if pairs is not None and len(pairs) == 1:
        pairs = pairs[0]
    elif pairs is not None and len(texts) == 1:
        texts = texts[0]
    elif pairs is not None and len(pairs) != len(texts):
        raise ValueError(f"--pair: {len(pairs)} given for {len(texts)} --text; expected one per "
                         "--text, one for all, or several for one --text")
    out = model.classify(texts, pairs, batch_size=args.batch_size)
    for row in out.to_rows():
        print(json.dumps(row))
    return 0
