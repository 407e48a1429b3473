"""A checkpoint's generation defaults: ``generation_config.json`` in an export.

Hugging Face checkpoints ship their stop ids (Llama 3 Instruct stops on any of three) and sampling
defaults in ``generation_config.json`` (and sometimes a list ``eos_token_id`` in ``config.json``).
The exporter keeps them in the export under the same name, in the subset below; the runtime uses
them wherever the caller passes nothing (``stop_token_ids=None``, ``temperature=None`` ...).
Torch-free: read by the exporter and the runtime alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .files import read_json_object

GENERATION_CONFIG_FILE = "generation_config.json"

# transformers' GenerationConfig defaults for what a file leaves out.
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """``eos_token_ids``: every id that ends a row (stop ids); ``do_sample`` false is greedy,
    true samples with ``temperature``, ``top_k`` (0: all) and ``top_p``."""

    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0

    def __post_init__(self) -> None:
        ids = self.eos_token_ids
        if not isinstance(ids, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"generation.eos_token_ids={ids!r}: expected a tuple of token ids")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"generation.do_sample={self.do_sample!r}: expected true or false")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or self.temperature < 0:
            raise ValueError(f"generation.temperature={self.temperature!r}: expected a number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"generation.top_k={self.top_k!r}: expected an integer >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p={self.top_p!r}: expected a number in (0, 1]")

    @property
    def sampling(self) -> dict[str, Any]:
        """Keyword arguments of ``Model.generate``: temperature 0 when greedy."""
        if not self.do_sample:
            return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
        return {"temperature": float(self.temperature), "top_k": self.top_k, "top_p": float(self.top_p)}

    @classmethod
    def from_hf(cls, generation: dict | None, config: dict | None, vocab_size: int) -> "GenerationDefaults | None":
        """From a checkpoint's ``generation_config.json`` and ``config.json`` (dicts or None):
        eos ids from the first that names any (an int or a list; ids outside the vocabulary are
        dropped), sampling fields from the generation config with transformers' defaults. None
        when neither says anything."""
        generation = generation or {}
        config = config or {}
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        ids = tuple(dict.fromkeys(i for i in eos if isinstance(i, int) and 0 <= i < vocab_size))
        fields = {k: generation.get(k) if generation.get(k) is not None else v for k, v in HF_DEFAULTS.items()}
        if not ids and not generation:
            return None
        return cls(eos_token_ids=ids, do_sample=bool(fields["do_sample"]), temperature=float(fields["temperature"]),
                   top_k=int(fields["top_k"]), top_p=float(fields["top_p"]))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["eos_token_id"] = list(data.pop("eos_token_ids"))  # the name transformers reads
        return data

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / GENERATION_CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path) -> "GenerationDefaults | None":
        """``directory/generation_config.json`` (as written by ``write``), or None."""
        path = Path(directory) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return None
        data = read_json_object(path)
        known = {"eos_token_id", "do_sample", "temperature", "top_k", "top_p"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; known fields are {sorted(known)}")
        eos = data.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, list):
            raise ValueError(f"{path}: eos_token_id={eos!r}: expected a token id or a list of them")
        rest = {k: v for k, v in data.items() if k != "eos_token_id"}
        return cls(eos_token_ids=tuple(eos), **rest)
