"""What the structured-output tests share: a byte-level tokenizer (JSON needs every byte; the
word-level one of ``runtime_cases`` has none of ``{":,}``), tiny decoders exported with it, and a
seeded family of JSON schemas."""

from __future__ import annotations

import random
from pathlib import Path

# [PAD] [BOS] [EOS], the 256 byte-level symbols, then merges of what JSON repeats.
SPECIALS = ["[PAD]", "[BOS]", "[EOS]"]
MERGES = [("{", '"'), ('"', ":"), (",", "Ġ"), ('"', ","), ('"', "}")]
# The models' vocabulary is wider than the tokenizer's (ONNX vocab padded): the grammar must
# never allow the ids past it.
VOCAB_SIZE = 272
# A chat template over it: "[BOS]<content>[EOS]" per message; [EOS] ends the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}[BOS]{{ m['content'] }}[EOS]{% endfor %}"
                 "{% if add_generation_prompt %}[BOS]{% endif %}")


def write_byte_tokenizer(path: Path) -> Path:
    """A byte-level BPE ``tokenizer.json``: every byte is a token, plus a few merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) < VOCAB_SIZE
    tokenizer = Tokenizer(models.BPE(vocab, MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path))
    return path


def export_byte_decoder(root: Path, name: str, target: str = "ort") -> Path:
    """A tiny random decoder (untied, so its greedy picks vary) with the byte-level tokenizer
    and the chat template, 256 positions."""
    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.presets import get_preset

    config = get_preset("tiny-decoder").replace(vocab_size=VOCAB_SIZE, max_positions=256, d_model=64,
                                                tie_embeddings=False)
    tokenizer = write_byte_tokenizer(root / f"{name}-tokenizer.json")
    path = root / name
    export_model(build_model(config, seed=0), path,
                 ExportOptions(target=target, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE))
    return path


_EXPORTS: dict[str, Path] = {}


def byte_decoder(tmp_path_factory, target: str) -> Path:
    """``export_byte_decoder`` for ``target`` ("portable": layout concat, "ort": inplace), once
    per test process: the library and the server tests share it."""
    if target not in _EXPORTS:
        _EXPORTS[target] = export_byte_decoder(tmp_path_factory.mktemp(f"grammar-{target}"), target, target)
    return _EXPORTS[target]


def schema_family(count: int, seed: int = 0) -> list[dict]:
    """``count`` JSON schemas, seeded: nested objects, arrays, enums, bounded numbers, strings
    with patterns and lengths, required and optional fields. Strings and arrays are bounded, so
    a random model's output ends within a few hundred tokens."""
    rng = random.Random(seed)

    def leaf() -> dict:
        kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean"])
        if kind == "string":
            return {"type": "string", "minLength": 1, "maxLength": rng.randint(2, 6)}
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^[A-Z][0-9]{2}$",
                                                             "^(yes|no)-[0-9]$"])}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, None], rng.randint(2, 4))}
        if kind == "integer":
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
        if kind == "number":
            # multipleOf bounds the fraction's digits (a random model would write them forever)
            return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000]),
                    "multipleOf": rng.choice([0.5, 0.25, 0.01])}
        return {"type": "boolean"}

    def node(depth: int) -> dict:
        kind = rng.choice(["object", "array", "leaf"] if depth else ["leaf"])
        if kind == "array":
            return {"type": "array", "items": node(depth - 1), "minItems": rng.randint(0, 1),
                    "maxItems": rng.randint(1, 3)}
        if kind == "object":
            return obj(depth - 1)
        return leaf()

    def obj(depth: int) -> dict:
        names = rng.sample(["id", "name", "tags", "size", "kind", "meta", "score", "ok"], rng.randint(1, 4))
        properties = {name: node(depth) for name in names}
        required = [name for name in names if rng.random() < 0.6]
        return {"type": "object", "properties": properties, "required": required,
                "additionalProperties": False}

    return [obj(2) for _ in range(count)]
