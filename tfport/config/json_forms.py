"""``ModelConfig`` as JSON: the nested form it writes (``{"rope": {"theta": ...}, ...}``), the flat
form earlier versions wrote (``"rope_theta": ...``; ``config.json`` and ``manifest.json`` of older
exports), which it still reads, and the flat view the settings fingerprint hashes, so that an
export's fingerprint does not depend on how its config is grouped."""

from __future__ import annotations

import dataclasses
from typing import Any

# The flat (ungrouped) name of each grouped field, as config files written before the grouping
# name it: flat name -> (part, field).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{f"rope_{name}": ("rope", name) for name in (
        "theta", "scaling", "scaling_factor", "original_max_positions", "low_freq_factor",
        "high_freq_factor", "local_theta", "short_factor", "long_factor", "attention_factor",
        "beta_fast", "beta_slow", "truncate", "interleaved")},
    "rotary_dim": ("rope", "rotary_dim"),
    "sliding_window": ("window", "size"),
    "local_layers": ("window", "layers"),
    "relative_buckets": ("relative", "buckets"),
    "relative_max_distance": ("relative", "max_distance"),
    "disentangled_buckets": ("disentangled", "buckets"),
    "disentangled_max_distance": ("disentangled", "max_distance"),
    "disentangled_terms": ("disentangled", "terms"),
    "n_labels": ("classifier", "n_labels"),
    "labels": ("classifier", "labels"),
    "classifier_pooling": ("classifier", "pooling"),
    "classifier_activation": ("classifier", "activation"),
    "classifier_norm": ("classifier", "norm"),
    "classifier_decoder_start": ("classifier", "decoder_start"),
    **{f"{name}_dropout": ("dropout", name) for name in ("embedding", "attention", "residual", "ffn")},
}
_GROUPED_NAMES = {path: flat for flat, path in FLAT_NAMES.items()}


def parts(cls: type) -> dict[str, type]:
    """``cls``'s grouped fields: name -> the part's class (its default factory)."""
    return {f.name: f.default_factory for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(f.default_factory)}


def _tuples(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """JSON lists -> tuples in ``cls``'s tuple fields (hashable, equal to the original)."""
    tuples = {f.name for f in dataclasses.fields(cls) if "tuple" in str(f.type)}
    return {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in data.items()}


def config_from_dict(cls: type, data: Any) -> Any:
    """A ``cls`` (``ModelConfig``) from its nested JSON form, the flat form or a mix; unknown or
    repeated fields raise ``ValueError`` naming them, a non-object ``TypeError``."""
    if not isinstance(data, dict):
        raise TypeError(f"config: expected a JSON object, got {type(data).__name__}")
    groups = parts(cls)
    top = {f.name for f in dataclasses.fields(cls)} - set(groups)
    values: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {name: {} for name in groups}
    unknown = []

    def put(group: str, name: str, value: Any, key: str) -> None:
        if name not in {f.name for f in dataclasses.fields(groups[group])}:
            unknown.append(key)
        elif name in grouped[group]:
            raise ValueError(f"config: {group}.{name} is given twice (grouped and as "
                             f"{_GROUPED_NAMES.get((group, name))!r}); keep one")
        else:
            grouped[group][name] = value

    for key, value in data.items():
        if key in groups:
            if not isinstance(value, dict):
                raise TypeError(f"config.{key}: expected a JSON object, got {type(value).__name__}")
            for name, inner in value.items():
                put(key, name, inner, f"{key}.{name}")
        elif key in FLAT_NAMES:
            put(*FLAT_NAMES[key], value, key)
        elif key in top:
            values[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"config: unknown field(s) {sorted(unknown)}; known fields are {known_fields(cls)}")
    values.update({name: part(**_tuples(part, grouped[name])) for name, part in groups.items()})
    return cls(**_tuples(cls, values))


def known_fields(cls: type) -> list[str]:
    """Every field's full path: ``d_model``, ``rope.theta`` ..."""
    groups = parts(cls)
    return sorted([f.name for f in dataclasses.fields(cls) if f.name not in groups]
                  + [f"{name}.{f.name}" for name, part in groups.items() for f in dataclasses.fields(part)])


def flat_fields(cls: type) -> dict[str, dataclasses.Field]:
    """Flat name -> the dataclass field (of ``cls`` or one of its parts) it holds; a grouped field
    without a flat name (added after the grouping) is ``part.field``."""
    groups = parts(cls)
    found = {f.name: f for f in dataclasses.fields(cls) if f.name not in groups}
    for name, part in groups.items():
        found.update({_GROUPED_NAMES.get((name, f.name), f"{name}.{f.name}"): f for f in dataclasses.fields(part)})
    return found


def flat_dict(config: Any) -> dict[str, Any]:
    """``config``'s fields under their flat names (``flat_fields``)."""
    groups = parts(type(config))
    values = {name: value for name, value in dataclasses.asdict(config).items() if name not in groups}
    for name in groups:
        part = dataclasses.asdict(getattr(config, name))
        values.update({_GROUPED_NAMES.get((name, key), f"{name}.{key}"): value for key, value in part.items()})
    return values
