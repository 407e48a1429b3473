"""Read a sentence-transformers checkpoint's pipeline into ``EmbeddingSettings``.

A sentence-transformers directory is a Hugging Face checkpoint plus ``modules.json``: a Transformer
module (the checkpoint itself, path ``""``), a Pooling module (``1_Pooling/config.json``) and
optionally a Normalize module. ``sentence_bert_config.json`` (or its older per-family names) holds
``max_seq_length``, to which ``SentenceTransformer.encode`` truncates. Modules whose computation
the runtime does not reproduce (Dense, LayerNorm, ...) are refused with their name: exporting
without them would give other vectors.
"""

from __future__ import annotations

import json
from pathlib import Path

from tfport.config.checks import is_int
from tfport.embedding import POOLINGS, EmbeddingSettings

MODULES_FILE = "modules.json"
# The Transformer module's settings; older releases named the file after the model family.
TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                       "sentence_distilbert_config.json", "sentence_camembert_config.json",
                       "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                       "sentence_xlnet_config.json")
# Legacy boolean keys of 1_Pooling/config.json -> the mode name.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
# tokenizer_config.json's model_max_length when a tokenizer has no limit (transformers' VERY_LARGE_INTEGER).
NO_LIMIT = 10**12


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None


def _kind(module_type: str) -> str:
    """``sentence_transformers.models.Pooling`` (or ``...modules.pooling.Pooling``) -> ``Pooling``."""
    return str(module_type).rsplit(".", 1)[-1]


def _pooling_mode(path: Path) -> str:
    config = _json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in LEGACY_POOLING_KEYS.items() if config.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1:
        raise ValueError(f"{path}: pooling modes {modes}: tfport exports one pooling mode "
                         f"(one of {list(POOLINGS)}), not a concatenation")
    if modes[0] not in POOLINGS:
        raise ValueError(f"{path}: pooling mode {modes[0]!r} is not one tfport computes "
                         f"(it computes {list(POOLINGS)})")
    if config.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt=false (prompt tokens excluded from pooling) is not "
                         "reproduced by tfport's runtime")
    return modes[0]


def _max_seq_length(directory: Path) -> tuple[int | None, bool]:
    """(max_seq_length, do_lower_case) from the Transformer module's config; without one,
    sentence-transformers truncates at the tokenizer's ``model_max_length``."""
    for name in TRANSFORMER_CONFIGS:
        path = directory / name
        if path.is_file():
            config = _json(path)
            if not isinstance(config, dict):
                raise ValueError(f"{path}: expected a JSON object")
            length = config.get("max_seq_length")
            if length is not None and (not is_int(length) or length < 1):
                raise ValueError(f"{path}: max_seq_length={length!r}: expected a positive integer")
            if length is not None:
                return length, bool(config.get("do_lower_case", False))
            lowercase = bool(config.get("do_lower_case", False))
            break
    else:
        lowercase = False
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        limit = _json(tokenizer_config).get("model_max_length")
        if is_int(limit) and 0 < limit < NO_LIMIT:
            return limit, lowercase
    return None, lowercase


def read_sentence_transformers(directory: str | Path) -> EmbeddingSettings | None:
    """The embedding pipeline of a sentence-transformers directory, or None when ``directory``
    has no ``modules.json``. Raises ``ValueError`` naming the file for a pipeline the runtime
    would not reproduce."""
    directory = Path(directory)
    path = directory / MODULES_FILE
    if not path.is_file():
        return None
    modules = _json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: expected a list of module objects")
    kinds = [_kind(m.get("type", "")) for m in modules]
    if not kinds or kinds[0] != "Transformer" or modules[0].get("path", "") not in ("", "."):
        raise ValueError(f"{path}: modules {kinds}: expected a Transformer module at the checkpoint's "
                         "root first")
    pooling, normalize = "cls", False
    seen_pooling = False
    for module, kind in zip(modules[1:], kinds[1:]):
        if kind == "Pooling" and not seen_pooling and not normalize:
            pooling = _pooling_mode(directory / module.get("path", "") / "config.json")
            seen_pooling = True
        elif kind == "Normalize" and not normalize:
            normalize = True
        else:
            raise ValueError(f"{path}: module {module.get('type')!r} (after {kinds[:kinds.index(kind)]}) "
                             "is not reproduced by tfport's runtime, which pools once and optionally "
                             "L2-normalises (Transformer, Pooling, Normalize)")
    if not seen_pooling:
        raise ValueError(f"{path}: modules {kinds}: expected a Pooling module (tfport exports sentence "
                         "embeddings, not token embeddings)")
    length, lowercase = _max_seq_length(directory)
    return EmbeddingSettings(pooling=pooling, normalize=normalize, max_seq_length=length, lowercase=lowercase)
