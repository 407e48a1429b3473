"""Config changes named by their full paths, for tables of cases (bad values above all, which a
part would refuse while the table is built): ``changed(config, {"rope.theta": 0.0})``."""

from __future__ import annotations

from typing import Any

from tfport.config import ModelConfig


def changed(config: ModelConfig, changes: dict[str, Any]) -> ModelConfig:
    """``config`` with ``changes`` applied: ``"d_model"`` a backbone field, ``"rope.theta"`` a
    field of a part (validated again, the part first)."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for path, value in changes.items():
        part, _, name = path.rpartition(".")
        if part:
            parts.setdefault(part, {})[name] = value
        else:
            top[name] = value
    return config.replace(**top, **{part: getattr(config, part).replace(**fields) for part, fields in parts.items()})
