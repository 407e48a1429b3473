"""How a sentence encoder turns states into one vector: ``embedding.json`` in an export.

sentence-transformers checkpoints say it in ``modules.json`` (a Pooling module, maybe a Normalize
module), ``1_Pooling/config.json`` (the pooling mode) and ``sentence_bert_config.json``
(``max_seq_length``: inputs are truncated to it). The exporter reads those
(``tfport.export.sentence_transformers``) and writes their content here, so the torch-free runtime
embeds exactly as ``SentenceTransformer.encode`` does by default without reading the checkpoint.
Importable without torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config.checks import is_int
from .files import read_json_object

EMBEDDING_FILE = "embedding.json"
# sentence-transformers' pooling modes that the runtime computes (tfport.runtime.encoding).
POOLINGS = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")


@dataclass(frozen=True)
class EmbeddingSettings:
    """``pooling`` (one of ``POOLINGS``), ``normalize`` (L2, the Normalize module),
    ``max_seq_length`` (inputs longer than this many tokens, special tokens included, are
    truncated; null: the model's own limit) and ``lowercase`` (sentence-transformers'
    ``do_lower_case``: texts are lowercased before tokenizing); ``matryoshka_dimensions``: the
    lengths a vector may be cut to (a model trained with Matryoshka loss, e.g. jina-embeddings-v3's
    config.json says them; null: none, the whole vector only)."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    lowercase: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"embedding.pooling={self.pooling!r}: expected one of {list(POOLINGS)}")
        for name in ("normalize", "lowercase"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"embedding.{name}={getattr(self, name)!r}: expected true or false")
        length = self.max_seq_length
        if length is not None and (not is_int(length) or length < 1):
            raise ValueError(f"embedding.max_seq_length={length!r}: expected a positive integer or null")
        dims = self.matryoshka_dimensions
        if isinstance(dims, list):  # as JSON reads it
            dims = tuple(dims)
            object.__setattr__(self, "matryoshka_dimensions", dims)
        if dims is not None and (not isinstance(dims, tuple) or not dims or any(
                not is_int(d) or d < 1 for d in dims)):
            raise ValueError(f"embedding.matryoshka_dimensions={dims!r}: expected a non-empty list "
                             "of positive integers or null")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.matryoshka_dimensions is None:  # left out: readers from before it take the file
            del data["matryoshka_dimensions"]
        return data

    @classmethod
    def from_dict(cls, data: Any, origin: str = EMBEDDING_FILE) -> "EmbeddingSettings":
        if not isinstance(data, dict):
            raise ValueError(f"{origin}: expected a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / EMBEDDING_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path) -> "EmbeddingSettings | None":
        """``directory/embedding.json``, or None when the export has none."""
        path = Path(directory) / EMBEDDING_FILE
        if not path.is_file():
            return None
        data = read_json_object(path)
        return cls.from_dict(data, str(path))
