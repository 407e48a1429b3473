"""The mapping language: how Hugging Face tensors become tfport tensors.

A ``Transform`` turns one or more HF tensors into one tfport tensor (and says which HF shapes it
expects, so shapes are checked before anything is read). A ``Rule`` names a tfport tensor
(``{i}`` stands for the layer index), the HF tensors it is made of and the transform; it may apply
only to some configs (``when``). An ``Architecture`` is one HF family: its config function (HF
config dict -> ``ModelConfig``, refusing what tfport cannot express exactly), its rules, and the HF
tensors it leaves unused on purpose (``ignored``) or holds twice (``duplicates``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from tfport.config import ModelConfig

Shape = tuple[int, ...]


# ---------------------------------------------------------------------------- tensor transforms
@dataclass(frozen=True)
class Transform:
    """How HF tensors become one tfport tensor.

    ``shapes(target_shape, config)`` are the HF shapes it expects (checked before reading);
    ``apply(tensors, target_shape, config)`` builds the tfport tensor.
    """

    name: str
    shapes: Callable[[Shape, ModelConfig], list[Shape]]
    apply: Callable[[list[torch.Tensor], Shape, ModelConfig], torch.Tensor]


COPY = Transform("copy", lambda shape, c: [shape], lambda ts, shape, c: ts[0])

# GPT-2's Conv1D stores [in, out]; nn.Linear holds [out, in].
CONV1D = Transform("transpose (Conv1D [in, out])", lambda shape, c: [shape[::-1]],
                   lambda ts, shape, c: ts[0].t())

# No HF tensor (MPT's LayerNorms have no bias): tfport's equivalent is a zero bias.
ZEROS = Transform("zeros", lambda shape, c: [], lambda ts, shape, c: torch.zeros(shape))


def _rows(config: ModelConfig, part: str) -> int:
    return (config.n_heads if part == "q" else config.kv_heads) * config.dim_per_head


def concat_rows(*parts: str) -> Transform:
    """Separate projections stacked along the output rows, e.g. ``("q", "kv", "kv")`` for the
    fused ``qkv`` ([H*D | Hkv*D | Hkv*D] rows); weights [out, in] and biases [out] alike."""
    return Transform(
        f"concatenate rows {'|'.join(parts)}",
        lambda shape, c: [(_rows(c, p), *shape[1:]) for p in parts],
        lambda ts, shape, c: torch.cat(ts, dim=0))


QKV = concat_rows("q", "kv", "kv")


def half_rows(index: int) -> Transform:
    """Half ``index`` (0 or 1) of a tensor whose rows are two equal parts, e.g. Phi-3's
    ``gate_up_proj`` ([gate | up] rows) -> ``ffn.gate`` and ``ffn.up``."""
    return Transform(f"rows half {index}", lambda shape, c: [(2 * shape[0], *shape[1:])],
                     lambda ts, shape, c: ts[0].chunk(2, dim=0)[index])


def _regroup_heads(ts: list[torch.Tensor], shape: Shape, c: ModelConfig) -> torch.Tensor:
    h, d = c.n_heads, c.dim_per_head
    rest = tuple(shape[1:])
    grouped = ts[0].reshape(h, 3, d, *rest)  # [H, 3, D, (E)]
    return grouped.transpose(0, 1).reshape(shape)  # [3, H, D, (E)] -> [q | k | v]


# BLOOM's query_key_value rows are per head (q_h, k_h, v_h); tfport's are [all q | all k | all v].
PER_HEAD_QKV = Transform("regroup rows [H, 3, D] -> [3, H, D]", lambda shape, c: [shape],
                         _regroup_heads)


# ------------------------------------------------------------------------------ mapping tables
@dataclass(frozen=True)
class Rule:
    """tfport tensor ``target`` (``{i}`` = layer index, ``{e}`` = expert index) is ``transform``
    of HF ``sources``."""

    target: str
    sources: tuple[str, ...]
    transform: Transform = COPY
    when: Callable[[ModelConfig], bool] | None = None  # only for configs where this holds
    # Only where the checkpoint holds every source (Falcon's two parallel norms or one shared one:
    # the config does not say which, the tensors do).
    if_present: bool = False
    # Each source stacks every expert's tensor [moe.n_experts, ...]; the transform reads expert
    # {e}'s slice (Granite-MoE's input_linear [N, 2F, E] / output_linear [N, E, F]).
    stacked: bool = False

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        pattern = re.escape(self.target).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
        return re.compile(pattern + "$")


def params(target: str, sources: str | tuple[str, ...], weight: Transform = COPY,
           bias: Transform = COPY) -> list[Rule]:
    """Rules for a module's ``target.weight`` and ``target.bias`` from HF ``source.weight`` and
    ``source.bias``. tfport modules without a bias never ask for the second rule; ``bias=ZEROS``
    reads nothing (the HF module has no bias where tfport's has one)."""
    sources = (sources,) if isinstance(sources, str) else sources
    bias_sources = () if bias is ZEROS else tuple(f"{s}.bias" for s in sources)
    return [Rule(f"{target}.weight", tuple(f"{s}.weight" for s in sources), weight),
            Rule(f"{target}.bias", bias_sources, bias)]


@dataclass(frozen=True)
class Architecture:
    """One HF model family: which configs it accepts, how they translate, where tensors go.

    ``base_prefix`` is the base model's prefix inside the task models (``model.`` in
    ``LlamaForCausalLM``); base-model files (``LlamaModel``) lack it and get it added. ``ignored``
    maps a regular expression over HF keys to the reason those tensors are unused; ``duplicates``
    names HF keys that are tied copies of another HF key (checked equal when present).
    """

    model_types: tuple[str, ...]
    classes: tuple[str, ...]
    base_prefix: str
    config: Callable[[dict, frozenset[str] | None], ModelConfig]
    rules: tuple[Rule, ...]
    ignored: dict[str, str] = field(default_factory=dict)
    duplicates: dict[str, str] = field(default_factory=dict)

    @functools.cached_property
    def head_prefixes(self) -> tuple[str, ...]:
        """First components of HF keys outside the base model (``lm_head.``, ``cls.``)."""
        return tuple(sorted({rule.sources[0].split(".")[0] + "." for rule in self.rules
                             if rule.sources and not rule.sources[0].startswith(self.base_prefix)}))

    def normalize(self, key: str) -> str:
        """HF key as the task model names it: base-model files (``LlamaModel``) lack the prefix.
        A head key may be a bare name (BART's ``final_logits_bias``)."""
        if key.startswith(self.base_prefix) or key.split(".")[0] + "." in self.head_prefixes:
            return key
        return self.base_prefix + key

    def rule(self, target: str, config: ModelConfig, has: Callable[[str], bool] | None = None
             ) -> tuple[Rule, dict[str, str]]:
        """The first rule for ``target`` whose ``when`` holds (and, for ``if_present`` rules,
        whose sources the checkpoint has: ``has(name)``) -> (rule, the ``{i}`` groups)."""
        for rule in self.rules:
            match = rule.pattern.match(target)
            if match and (rule.when is None or rule.when(config)):
                groups = match.groupdict()
                if rule.if_present and not (has is not None and all(has(s.format(**groups)) for s in rule.sources)):
                    continue
                return rule, groups
        raise AssertionError(f"no HF rule for tfport tensor {target!r} ({self.model_types})")


def decoder_lm(layer: str, embed: str, final_norm: str, norms: tuple[str, str], attn: list[Rule],
               ffn: list[Rule], norm_bias: Transform = COPY, extra: Iterable[Rule] = ()
               ) -> tuple[Rule, ...]:
    """The rules every decoder-only family shares, given its HF names for each part."""
    return (
        Rule("decoder.embed.tokens.weight", (embed,)),
        *params("decoder.layers.{i}.attn_norm", f"{layer}.{norms[0]}", bias=norm_bias),
        *attn,
        *params("decoder.layers.{i}.ffn_norm", f"{layer}.{norms[1]}", bias=norm_bias),
        *ffn,
        *params("decoder.norm", final_norm, bias=norm_bias),
        Rule("lm_head.weight", ("lm_head.weight",)),
        *extra,
    )
