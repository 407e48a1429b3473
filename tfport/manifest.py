"""``manifest.json``: what an export directory holds, written by the exporter beside its graphs
and read and checked by the runtime before anything else (``Manifest``).

It records the config, the dtype and cache layout the graphs were built for (their I/O follows
from them: ``tfport.contract.graph_specs``), the tokenizer and chat template files, and (format
3) every other file's size and sha256 (``tfport.integrity``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .config.checks import is_int
from .contract import (CHAT_TEMPLATE_FILE, CONFIG_FILE, DTYPES, LAYOUTS, MANIFEST_FILE, TOKENIZER_FILE,
                       GraphSpec, graph_specs)
from .dtypes import CACHE_DTYPES, cache_dtype
from .integrity import FileRecord, export_settings, parse_file_records

FORMAT_NAME = "tfport"
# 2: cache layout and device refusals recorded (version 1 had target names only); 3: every file's
# size and sha256 (``files``), and each graph's settings fingerprint in its metadata.
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)  # format 2 loads without the integrity checks (the runtime warns)


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` in an export directory says."""

    config: ModelConfig
    dtype: str = "float32"
    opset: int = 18
    target: str = "portable"  # the export target that wrote the graphs (informational)
    layout: str = "concat"  # the decoder's cache layout (LAYOUTS); the runtime decodes by it
    # Devices the graphs must not run on, with the reason (e.g. a fused kernel without a float32
    # CUDA implementation): {"cuda": "..."}.
    device_refusals: dict[str, str] = field(default_factory=dict)
    tokenizer: str | None = None
    chat_template: str | None = None  # file name of the checkpoint's Jinja chat template
    graphs: dict[str, GraphSpec] = field(default_factory=dict)
    # Every other file of the export -> size and sha256 (tfport.integrity); None when read from a
    # format-2 manifest, which records none.
    files: dict[str, FileRecord] | None = None
    # Quantisation of the graphs' weight products (its scheme's to_dict, export/quant/: format,
    # then the format's own fields, e.g. bits, block_size, symmetric, embeddings), None for float weights.
    quantization: dict[str, Any] | None = None
    kv_dtype: str | None = None  # the KV cache dtype (None: the dtype's default, set on creation)

    def __post_init__(self) -> None:
        if self.dtype in DTYPES:
            object.__setattr__(self, "kv_dtype", cache_dtype(self.dtype, self.kv_dtype))
        if not self.graphs:
            object.__setattr__(self, "graphs", graph_specs(self.config, self.dtype, self.layout,
                                                           self.kv_dtype))

    @property
    def settings(self) -> str:
        """Canonical JSON of what the graphs are built for; its sha256 is in each graph's
        metadata (``tfport.integrity.export_settings``)."""
        return export_settings(self.config, self.dtype, self.opset, self.target, self.layout,
                               self.device_refusals, self.kv_dtype)

    def required_files(self) -> list[str]:
        """Files the runtime reads besides the manifest: graphs, config, tokenizer, template."""
        names = [g.file for g in self.graphs.values()] + [CONFIG_FILE]
        return names + [n for n in (self.tokenizer, self.chat_template) if n is not None]

    def to_dict(self) -> dict[str, Any]:
        if self.files is None:
            raise ValueError("manifest: files is None; record them (tfport.integrity.record_files) "
                             "before writing")
        return {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dtype": self.dtype,
            "opset": self.opset, "target": self.target, "layout": self.layout,
            "device_refusals": dict(self.device_refusals), "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "config": self.config.to_dict(),
            "graphs": {name: g.to_dict() for name, g in self.graphs.items()},
            "files": {name: record.to_dict() for name, record in self.files.items()},
            **({"quantization": dict(self.quantization)} if self.quantization else {}),
            "kv_dtype": self.kv_dtype,
        }

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path) -> "Manifest":
        """Read and check ``directory/manifest.json``; ``ValueError`` names the directory or the
        manifest file and says what is wrong.

        Checks the structure and every field's type, that the graphs match the contract for the
        config, that they exist, and (format 3) that ``files`` records every file the runtime
        reads. File contents are checked by ``tfport.integrity.verify_files``.
        """
        directory = Path(directory)
        path = directory / MANIFEST_FILE
        try:
            found = directory.is_dir(), path.is_file()
        except OSError as err:  # e.g. a name too long for the file system
            raise ValueError(f"model_dir={str(directory)!r}: cannot be opened ({err.strerror})") from None
        if not found[0]:
            raise ValueError(f"model_dir={str(directory)!r}: expected a directory made by 'tfport export'")
        if not found[1]:
            raise ValueError(f"model_dir={str(directory)!r}: no {MANIFEST_FILE}; expected a "
                             "directory made by 'tfport export'")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ValueError(f"{path}: expected format {FORMAT_NAME!r}, got "
                             f"{data.get('format') if isinstance(data, dict) else data!r}")
        version = data.get("format_version")
        if type(version) is not int or version not in READ_VERSIONS:
            raise ValueError(f"{path}: format_version={version!r}, this tfport reads "
                             f"{list(READ_VERSIONS)} (re-export with this tfport version)")
        if version < 3 and "files" in data:  # an edited format-3 manifest: its checks would be off
            raise ValueError(f"{path}: format_version={version!r} but a 'files' section, which "
                             "only format 3 writes; the manifest was edited: restore "
                             "format_version 3 or re-export")
        required = ["config", "dtype", "opset", "target", "layout", "graphs"]
        missing = [key for key in required + ["files"] * (version >= 3) if key not in data]
        if missing:
            raise ValueError(f"model_dir={str(directory)!r}: {MANIFEST_FILE} is incomplete or "
                             f"malformed (no {missing}); re-export it")
        try:
            config = ModelConfig.from_dict(data["config"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None
        _check_field(path, data, "dtype", data["dtype"] in DTYPES, f"one of {list(DTYPES)}")
        _check_field(path, data, "kv_dtype", data.get("kv_dtype") in (None, *CACHE_DTYPES[data["dtype"]]),
                     f"one of {list(CACHE_DTYPES[data['dtype']])} for dtype {data['dtype']!r}")
        opset = data["opset"]
        _check_field(path, data, "opset", is_int(opset) and opset > 0, "a positive integer")
        _check_field(path, data, "target", isinstance(data["target"], str), "a target name")
        _check_field(path, data, "layout", isinstance(data["layout"], str) and data["layout"] in LAYOUTS,
                     f"one of {sorted(LAYOUTS)}")
        for key, name in (("tokenizer", TOKENIZER_FILE), ("chat_template", CHAT_TEMPLATE_FILE)):
            _check_field(path, data, key, data.get(key) in (None, name), f"null or {name!r}")
        refusals = data.get("device_refusals", {})
        _check_field(path, data, "device_refusals", isinstance(refusals, dict)
                     and all(isinstance(v, str) for v in refusals.values()), "device -> reason")
        _check_field(path, data, "graphs", isinstance(data["graphs"], dict), "graph name -> spec")
        files = parse_file_records(data["files"], str(path)) if version >= 3 else None
        try:
            manifest = cls(config=config, dtype=data["dtype"], opset=opset, target=data["target"],
                           layout=data["layout"], device_refusals=refusals,
                           tokenizer=data.get("tokenizer"), chat_template=data.get("chat_template"),
                           files=files, quantization=data.get("quantization"),
                           kv_dtype=data.get("kv_dtype"))
        except ValueError as err:  # a config the layout cannot serve
            raise ValueError(f"{path}: {err}") from None
        for name, graph in manifest.graphs.items():
            if data["graphs"].get(name) != graph.to_dict():
                raise ValueError(f"{path}: graph {name!r} does not match the contract for its "
                                 f"config (re-export with this tfport version)")
            if not (directory / graph.file).is_file():
                raise ValueError(f"model_dir={str(directory)!r}: graph file {graph.file!r} is missing")
        if files is not None:
            unrecorded = [name for name in manifest.required_files() if name not in files]
            if unrecorded:
                raise ValueError(f"{path}: files does not record {unrecorded}; re-export it")
        return manifest


def _check_field(path: Path, data: dict, key: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{path}: {key}={data.get(key)!r}: expected {expected}")
