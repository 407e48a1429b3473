"""Opening an export directory (``Model.load``): its manifest read and checked, its files
verified against the sizes and sha256 the manifest records (``tfport.integrity``), one ONNX
Runtime session per graph with its settings fingerprint checked, and the manifest's device
refusals applied."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from tfport.contract import MANIFEST_FILE
from tfport.integrity import VERIFY_MODES, check_graph_metadata, verify_files
from tfport.manifest import Manifest

from .binding import GraphRunner
from .session import SessionSettings, export_config, graph_metadata, open_session

logger = logging.getLogger(__name__)


def open_export(model_dir: str | os.PathLike, settings: SessionSettings, verify: str = "full"
                ) -> tuple[Path, Manifest, dict[str, GraphRunner], SessionSettings]:
    """Open ``model_dir`` with ``settings``, checked as ``verify`` says (see ``Model.load``) ->
    (the directory, its manifest, graph name -> runner, the settings the sessions got: provider
    ``"auto"`` resolved to the first graph's device)."""
    if not isinstance(model_dir, (str, os.PathLike)) or isinstance(os.fspath(model_dir), bytes):
        raise TypeError(f"model_dir: expected a path, got {type(model_dir).__name__} (pass a "
                        "str or os.PathLike)")
    if not isinstance(verify, str) or verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: expected one of {list(VERIFY_MODES)}")
    directory = Path(model_dir)
    try:
        manifest = Manifest.read(directory)  # ValueError naming model_dir when not an export
    except (KeyError, TypeError) as err:
        raise ValueError(f"model_dir={str(directory)!r}: {MANIFEST_FILE} is incomplete or "
                         f"malformed ({type(err).__name__}: {err}); re-export it") from None
    if manifest.files is None:
        if verify != "none":
            raise ValueError(f"model_dir={str(directory)!r}: written by an older tfport (manifest "
                             f"format 2), which records no file hashes or settings fingerprints, "
                             f"so verify={verify!r} cannot check it; re-export it, or load it "
                             "unverified with verify='none' (--verify none)")
        logger.warning("model_dir=%r: written by an older tfport (manifest format 2), which "
                       "records no file hashes or settings fingerprints: nothing is verified; "
                       "re-export to get the checks", str(directory))
    else:
        verify_files(directory, manifest.files, verify)
    runners, config = {}, export_config(manifest.quantization)
    for name, spec in manifest.graphs.items():
        session = open_session(directory / spec.file, spec, settings, config=config)
        if manifest.files is not None:
            check_graph_metadata(graph_metadata(session, spec.file), manifest.settings,
                                 spec.file, f"model_dir={str(directory)!r}")
        runners[name] = GraphRunner(session, spec, settings.device_id)
        if settings.provider == "auto":  # the other graphs follow the first one's device
            chosen = "cuda" if runners[name].device == "cuda" else "cpu"
            settings = dataclasses.replace(settings, provider=chosen)
    for device in {r.device for r in runners.values()} & set(manifest.device_refusals):
        raise ValueError(f"model_dir={str(directory)!r}: {manifest.device_refusals[device]}")
    return directory, manifest, runners, settings

