"""Tying an export's files to its manifest, so a mixed-up or damaged directory fails at load.

Two records, both written by the exporter and checked by the runtime (standard library only):

* **File hashes.** ``manifest.json`` lists every other file of the export (graphs, their
  ``.onnx.data``, ``config.json``, ``tokenizer.json``, ``chat_template.jinja``) with its size and
  sha256. ``verify_files`` checks them before any session is opened: a graph copied in from
  another export, zeroed or flipped weights, a truncated file fail with a ``ValueError`` naming
  the file. ``verify="fast"`` hashes only files up to ``FAST_HASH_LIMIT`` bytes and checks the
  size of larger ones (the weights of a big model); ``"none"`` checks nothing; both log what
  they skip.
* **Settings fingerprint.** Each graph carries, in its ONNX metadata, the canonical JSON of the
  export settings the graph was built for (config, dtype, opset, target, cache layout, device
  refusals) and its sha256. ``check_graph_metadata`` compares them with the manifest, so a
  manifest edited after export (``max_positions``, ``rope_theta``, ``norm_eps``, ``opset``) is
  refused with the fields that differ instead of failing mid-generation or silently running
  past the trained length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .config.checks import is_int
from .config.json_forms import FLAT_NAMES, flat_dict, flat_fields
from .dtypes import CACHE_DTYPES

logger = logging.getLogger(__name__)

FINGERPRINT_KEY = "tfport.fingerprint"  # graph metadata: sha256 of SETTINGS_KEY's value
SETTINGS_KEY = "tfport.settings"  # graph metadata: canonical JSON of the export settings
VERIFY_MODES = ("full", "fast", "none")
FAST_HASH_LIMIT = 64 * 2**20  # verify="fast" hashes files up to this size, size-checks the rest
_CHUNK = 2**20  # bytes read per hash update: large files are streamed, never read whole
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says about one file: its size in bytes and its sha256 (hex)."""

    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_files(directory: str | Path, names: Iterable[str]) -> dict[str, FileRecord]:
    """Size and sha256 of each named file of ``directory``, sorted by name."""
    directory = Path(directory)
    return {name: FileRecord((directory / name).stat().st_size, sha256_file(directory / name))
            for name in sorted(names)}


def is_plain_name(name: object) -> bool:
    """Whether ``name`` names a file directly inside a directory (no separators, no ``..``)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def parse_file_records(value: object, where: str) -> dict[str, FileRecord]:
    """``{name: {"bytes": int, "sha256": hex}}`` from a manifest -> records; ``ValueError``
    naming ``where`` (the manifest path) for anything else."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: files={value!r}: expected an object of file name -> "
                         "{'bytes': size, 'sha256': hex digest}")
    records = {}
    for name, entry in value.items():
        if not is_plain_name(name):
            raise ValueError(f"{where}: files: {name!r} is not a file name inside the export")
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            raise ValueError(f"{where}: files[{name!r}]={entry!r}: expected "
                             "{'bytes': size, 'sha256': hex digest}")
        size, digest = entry["bytes"], entry["sha256"]
        if not is_int(size) or size < 0:
            raise ValueError(f"{where}: files[{name!r}].bytes={size!r}: expected a size >= 0")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ValueError(f"{where}: files[{name!r}].sha256={digest!r}: expected 64 "
                             "lowercase hex digits")
        records[name] = FileRecord(size, digest)
    return records


def verify_files(directory: str | Path, records: Mapping[str, FileRecord], mode: str = "full",
                 argument: str = "model_dir") -> None:
    """Check the files of ``directory`` against their ``records``; ``ValueError`` naming
    ``argument`` and the first file that is missing, has another size or another sha256.

    ``mode`` is one of ``VERIFY_MODES``: ``"full"`` hashes every file, ``"fast"`` hashes files
    up to ``FAST_HASH_LIMIT`` bytes and only size-checks larger ones, ``"none"`` checks nothing.
    What is skipped is logged as a warning, with the file names.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={mode!r}: expected one of {list(VERIFY_MODES)}")
    directory = Path(directory)
    if mode == "none":
        logger.warning("verify='none': the size and sha256 of %s in %s are not checked; a "
                       "damaged or mixed-up file will fail later or give wrong output",
                       sorted(records), directory)
        return
    skipped = []
    for name, record in records.items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{argument}={str(directory)!r}: {name!r}, listed in manifest.json, "
                             "is missing; copy the whole export directory")
        size = path.stat().st_size
        if size != record.size:
            raise ValueError(f"{argument}={str(directory)!r}: {name!r} has {size} bytes, "
                             f"manifest.json records {record.size} (truncated, or from another "
                             "export?); re-export or copy the export again")
        if mode == "fast" and size > FAST_HASH_LIMIT:
            skipped.append(name)
            continue
        if sha256_file(path) != record.sha256:
            raise ValueError(f"{argument}={str(directory)!r}: {name!r} does not match the sha256 "
                             "that manifest.json records: it was modified, damaged or copied from "
                             "another export; re-export or copy the export again")
    if skipped:
        logger.warning("verify='fast': %s (over %d MiB) checked by size only, not hashed; use "
                       "verify='full' to hash them", skipped, FAST_HASH_LIMIT // 2**20)


# --------------------------------------------------------------------------- settings fingerprint
def _defaults() -> dict[str, Any]:
    """ModelConfig field, by its flat name (``rope_theta``), -> its default (fields without one
    are left out)."""
    return {name: f.default for name, f in flat_fields(ModelConfig).items()
            if f.default is not dataclasses.MISSING}


def _canonical_config(config: ModelConfig) -> dict[str, Any]:
    """The config's fields that differ from their defaults, integers in float fields as floats:
    a field added to ModelConfig later (at its default) does not change the fingerprint of
    existing exports, and ``"rope_theta": 10000`` equals ``10000.0``. Fields go by their flat
    names (``tfport.config.json_forms.flat_dict``), so grouping the config changed no fingerprint."""
    floats = {name for name, f in flat_fields(ModelConfig).items() if "float" in str(f.type)}
    defaults = _defaults()
    values = {}
    for name, value in flat_dict(config).items():
        if name in floats and is_int(value):
            value = float(value)
        if name not in defaults or value != defaults[name] or type(value) is not type(defaults[name]):
            values[name] = value
    return values


def export_settings(config: ModelConfig, dtype: str, opset: int, target: str, layout: str,
                    device_refusals: Mapping[str, str], kv_dtype: str | None = None) -> str:
    """Canonical JSON of what a graph is built for (sorted keys, no spaces; the config as
    ``_canonical_config``); ``kv_dtype`` is recorded when it is not ``dtype``'s default cache
    dtype, so exports made before the option keep their fingerprints."""
    settings = {"config": _canonical_config(config), "dtype": dtype, "opset": opset,
                "target": target, "layout": layout, "device_refusals": dict(device_refusals)}
    if kv_dtype is not None and dtype in CACHE_DTYPES and kv_dtype != CACHE_DTYPES[dtype][0]:
        settings["kv_dtype"] = kv_dtype
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def fingerprint(settings: str) -> str:
    return hashlib.sha256(settings.encode()).hexdigest()


def graph_metadata(settings: str) -> dict[str, str]:
    """The metadata entries the exporter puts in each graph."""
    return {SETTINGS_KEY: settings, FINGERPRINT_KEY: fingerprint(settings)}


def _fields(settings: str) -> dict[str, Any]:
    """Settings JSON -> {"dtype": ..., "config.max_positions": ..., "config.rope.theta": ...},
    config fields left out of the JSON at their defaults, named by their full path."""
    data = json.loads(settings)
    fields = {key: value for key, value in data.items() if key != "config"}
    config = {**_defaults(), **data.get("config", {})}
    fields.update({f"config.{'.'.join(FLAT_NAMES.get(key, (key,)))}": value for key, value in config.items()})
    return fields


def _differences(recorded: str, expected: str) -> list[str]:
    """``field: manifest X, graph Y`` for each field that differs (empty if unreadable)."""
    try:
        graph, manifest = _fields(recorded), _fields(expected)
    except (json.JSONDecodeError, AttributeError, TypeError):
        return []
    return [f"{key}: manifest {_show(manifest, key)}, graph {_show(graph, key)}"
            for key in sorted(set(graph) | set(manifest))
            if key not in graph or key not in manifest or graph[key] != manifest[key]]


def _show(fields: dict[str, Any], key: str) -> str:
    return repr(fields[key]) if key in fields else "(absent)"


def check_graph_metadata(metadata: Mapping[str, str], settings: str, file: str,
                         argument: str = "model_dir") -> None:
    """``ValueError`` naming ``file`` unless the graph's metadata carries the fingerprint of
    ``settings`` (the manifest's ``export_settings``), listing the fields that differ."""
    recorded = metadata.get(FINGERPRINT_KEY)
    if recorded is None:
        raise ValueError(f"{argument}: graph {file!r} carries no {FINGERPRINT_KEY!r} metadata: it "
                         "was not written by the export this manifest.json describes; re-export")
    if recorded == fingerprint(settings):
        return
    differences = _differences(metadata.get(SETTINGS_KEY, ""), settings)
    detail = ("; ".join(differences) if differences else
              "its settings fingerprint differs; it may come from another tfport version")
    raise ValueError(f"{argument}: manifest.json does not describe graph {file!r} ({detail}): the "
                     "manifest was edited or the graph comes from another export; re-export")
