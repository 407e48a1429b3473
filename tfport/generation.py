"""A checkpoint's generation defaults: ``generation_config.json`` in an export.

Hugging Face checkpoints ship their stop ids (Llama 3 Instruct stops on any of three), sampling
defaults and forced tokens (BART's ``forced_eos_token_id``, mBART-50's ``forced_bos_token_id``) in
``generation_config.json`` (and sometimes in ``config.json``).
The exporter keeps them in the export under the same name, in the subset below; the runtime uses
them wherever the caller passes nothing (``stop_token_ids=None``, ``temperature=None`` ...).
Torch-free: read by the exporter and the runtime alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config.checks import is_int, is_number
from .files import read_json_object

GENERATION_CONFIG_FILE = "generation_config.json"

# transformers' GenerationConfig defaults for what a file leaves out.
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """``eos_token_ids``: every id that ends a row (stop ids); ``do_sample`` false is greedy,
    true samples with ``temperature``, ``top_k`` (0: all) and ``top_p``. ``repetition_penalty``
    (> 0, 1 off) applies greedy or sampled, as transformers applies it.

    Forced tokens, as transformers' ForcedBOS / ForcedEOS logits processors apply them:
    ``forced_bos_token_id`` is the first generated token when the decoder input is one token (a
    seq2seq model's start token: mBART-50's target language code); ``forced_eos_token_ids`` are
    the only tokens allowed at the last of ``max_new_tokens`` steps (BART, Marian: a row still
    running when the length runs out ends with eos). Every other logit is -inf there and the
    forced ones 0, so greedy picks the first of several and sampling any of them.
    """

    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("eos_token_ids", "forced_eos_token_ids"):
            ids = getattr(self, field)
            if not isinstance(ids, tuple) or not all(_is_id(i) for i in ids):
                raise ValueError(f"generation.{field}={ids!r}: expected a tuple of token ids")
        if self.forced_bos_token_id is not None and not _is_id(self.forced_bos_token_id):
            raise ValueError(f"generation.forced_bos_token_id={self.forced_bos_token_id!r}: expected a "
                             "token id or null")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"generation.do_sample={self.do_sample!r}: expected true or false")
        if not is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"generation.temperature={self.temperature!r}: expected a finite number >= 0")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"generation.top_k={self.top_k!r}: expected an integer >= 0")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p={self.top_p!r}: expected a number in (0, 1]")
        penalty = self.repetition_penalty
        if not is_number(penalty) or not 0 < penalty < float("inf"):
            raise ValueError(f"generation.repetition_penalty={penalty!r}: expected a finite number > 0 (1 is off)")

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
        dropped), forced bos / eos ids likewise (``ValueError`` for one outside the vocabulary:
        transformers could not force it either), sampling fields from the generation config with
        transformers' defaults. None when neither says anything."""
        generation = generation or {}
        config = config or {}
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        ids = tuple(dict.fromkeys(i for i in eos if isinstance(i, int) and 0 <= i < vocab_size))
        forced = {}
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            value = generation.get(name, config.get(name))
            values = [value] if isinstance(value, int) else list(value or [])
            if not all(_is_id(i) and i < vocab_size for i in values) or (name == "forced_bos_token_id"
                                                                        and len(values) > 1):
                raise ValueError(f"{name}={value!r}: expected {'a token id' if 'bos' in name else 'token ids'} "
                                 f"in [0, {vocab_size}) or null")
            forced[name] = values
        fields = {k: generation.get(k) if generation.get(k) is not None else v for k, v in HF_DEFAULTS.items()}
        if not ids and not generation:
            return None
        return cls(eos_token_ids=ids, do_sample=bool(fields["do_sample"]), temperature=float(fields["temperature"]),
                   top_k=int(fields["top_k"]), top_p=float(fields["top_p"]),
                   repetition_penalty=float(fields["repetition_penalty"]),
                   forced_bos_token_id=forced["forced_bos_token_id"][0] if forced["forced_bos_token_id"] else None,
                   forced_eos_token_ids=tuple(forced["forced_eos_token_id"]))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["eos_token_id"] = list(data.pop("eos_token_ids"))  # the names transformers reads
        data["forced_eos_token_id"] = list(data.pop("forced_eos_token_ids")) or None
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
        known = {"eos_token_id", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                 "forced_bos_token_id", "forced_eos_token_id"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; known fields are {sorted(known)}")
        lists = {}
        for name in ("eos_token_id", "forced_eos_token_id"):
            ids = data.get(name)
            ids = [ids] if isinstance(ids, int) else [] if ids is None else ids
            if not isinstance(ids, list):
                raise ValueError(f"{path}: {name}={ids!r}: expected a token id or a list of them")
            lists[name + "s"] = tuple(ids)
        rest = {k: v for k, v in data.items() if k not in ("eos_token_id", "forced_eos_token_id")}
        try:
            return cls(**lists, **rest)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def _is_id(value: Any) -> bool:
    return is_int(value) and value >= 0
