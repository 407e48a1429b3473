"""Tiny GGUF files written from tiny transformers models, the way llama.cpp's converter writes them.

Tensor names come from gguf-py's ``TensorNameMap`` (the table llama.cpp's converter uses), not
from tfport's mapping; the converter's arithmetic (convert_hf_to_gguf.py) is written out here,
independently of tfport's inverse: Gemma's norm weights stored as 1 + w, Gemma 1/2's head dropped
(tied); LLaMA's Q/K rows permuted (only LLaMA's converter permutes); GPT-2's Conv1D weights
transposed and its head written as a copy of the embeddings; BLOOM's per-head QKV and Falcon's
per-KV-group QKV regrouped to [all q | all k | all v]; Phi-2's q/k/v fused where a case asks
(its original layout); RoPE scaling as metadata (linear, YaRN)
or tensors (rope_freqs for llama3, rope_factors_long/short for LongRoPE); a mixture's experts
read per expert from the saved checkpoint and stacked into one [N, out, in] tensor per layer and
projection. Metadata: the ``{arch}.*`` keys the converter writes for each family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..hf.cases import HFCase, build_hf

# transformers config fields -> (GGUFWriter method); only those the case's config sets.
METADATA = {
    "max_position_embeddings": "add_context_length", "num_hidden_layers": "add_block_count",
    "hidden_size": "add_embedding_length", "intermediate_size": "add_feed_forward_length",
    "num_attention_heads": "add_head_count", "num_key_value_heads": "add_head_count_kv",
    "rms_norm_eps": "add_layer_norm_rms_eps", "layer_norm_eps": "add_layer_norm_eps",
    "layer_norm_epsilon": "add_layer_norm_eps", "norm_epsilon": "add_layer_norm_eps",  # StarCoder2
    # mixtures of experts (TextModel / Qwen2MoeModel.set_gguf_parameters)
    "num_local_experts": "add_expert_count", "num_experts": "add_expert_count",
    "num_experts_per_tok": "add_expert_used_count", "moe_intermediate_size": "add_expert_feed_forward_length",
    "shared_expert_intermediate_size": "add_expert_shared_feed_forward_length",
}
# Families whose converter writes a 4x feed-forward length (their configs have no intermediate_size).
FOUR_X_FFN = ("gpt2", "bloom", "mpt", "falcon")
# Families whose converter writes the tied head as its own tensor, a copy of these embeddings.
HEAD_COPIED = {"gpt2": "transformer.wte.weight", "bloom": "transformer.word_embeddings.weight"}


@dataclass(frozen=True)
class GGUFCase:
    """One tiny file: the GGUF architecture, its source transformers model, how it is stored."""

    name: str
    arch: str                       # general.architecture
    source: HFCase                  # the transformers model the file is written from
    # 2-D and 3-D weights: F16 rounds the source model first (exact); a block type (Q8_0, Q4_0,
    # with gguf-py's quantiser) leaves it as it is (the file is then compared with its import)
    weight_type: str = "F32"
    # None: transformers' GGUF loader reads the file as the source model computes; else why not
    # (the file is then compared with the source model only).
    transformers_differs: str | None = None
    metadata: dict = field(default_factory=dict)  # extra "{arch}.<suffix>" -> value (None: left out)
    # q, k and v written as one attn_qkv ([q | k | v] rows): Phi-2 files converted from its
    # original layout (mixer.Wqkv), before transformers' PhiForCausalLM split it
    fused_qkv: bool = False


@dataclass
class Written:
    path: Path
    hf: torch.nn.Module             # the source model (eval, float32)


def _rope(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("full_attention", params)


def llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rows of each head (first half, second half)
    -> interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for llama3 scaling. (The
    converter reads the trained length from the config's top level, 8192 when absent; the tiny
    models state theirs in the RoPE parameters, read here.)"""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_rope(writer, case: GGUFCase, config, head_dim: int) -> dict[str, np.ndarray]:
    """The RoPE metadata the converter writes; returns the RoPE tensors it adds."""
    rope = _rope(config)
    if not rope:  # learned positions or ALiBi: no RoPE keys
        return {}
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    kind = rope.get("rope_type", "default")
    import gguf

    if kind == "llama3":
        return {"rope_freqs.weight": llama3_rope_freqs(rope, head_dim)}
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for name, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                          ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                          ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(name) is not None:
                add(rope[name])
    if kind == "longrope":  # Phi3MiniModel: the attention factor it computes, the factors as tensors
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
        return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    return {}


def _add_metadata(writer, key: str, value) -> None:
    """Add (or overwrite) ``key``; None removes what the converter wrote (a case without it)."""
    if value is None:
        for shard in writer.kv_data:
            shard.pop(key, None)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_float32(key, value)


def _converted(arch: str, stem: str, values: np.ndarray, config) -> np.ndarray:
    """The converter's arithmetic on one HF tensor (``stem`` without .weight / .bias)."""
    heads = config.num_attention_heads
    if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
        kv = getattr(config, "num_key_value_heads", heads)
        return llama_permute(values, heads if stem.endswith("q_proj") else kv)
    if arch == "gpt2" and values.ndim == 2 and stem.endswith(("c_attn", "c_proj", "c_fc")):
        return values.T.copy()
    if arch == "bloom" and stem.endswith("query_key_value"):  # [H, 3, D, (E)] -> [3, H, D, (E)]
        return values.reshape(heads, 3, -1, *values.shape[1:]).swapaxes(0, 1).reshape(values.shape)
    if arch == "falcon" and stem.endswith("query_key_value") and config.new_decoder_architecture:
        kv = config.num_kv_heads  # [Hkv, G + 2, D, (E)] -> [q | k | v]
        groups = values.reshape(kv, heads // kv + 2, -1, *values.shape[1:])
        rows = [groups[:, :-2], groups[:, -2:-1], groups[:, -1:]]
        return np.concatenate([r.reshape(-1, *values.shape[1:]) for r in rows])
    return values


EXPERT = re.compile(r"(?P<stack>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight")


def checkpoint_tensors(hf, directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``hf``'s checkpoint, which the converter reads: transformers 5 keeps a
    mixture's experts fused in memory (``experts.gate_up_proj`` [N, 2F, E]) and writes them one
    per expert and projection with ``save_pretrained``, as published MoE checkpoints hold them."""
    state = dict(hf.state_dict())
    if not any(".experts." in name for name in state):
        return state
    from safetensors.torch import load_file

    hf.save_pretrained(directory / "checkpoint")
    return load_file(str(directory / "checkpoint" / "model.safetensors"))


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converter's merge of each layer's experts: ``...experts.{e}.{projection}.weight`` [out,
    in] for e = 0..N-1 -> ``...experts.{projection}.weight`` [N, out, in] (torch.stack, dim 0)."""
    out, stacks = {}, {}
    for name, tensor in state.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            stacks.setdefault(f"{match['stack']}.{match['projection']}.weight", {})[int(match["expert"])] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def fuse_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``...self_attn.{q,k,v}_proj.{weight,bias}`` -> ``...self_attn.qkv_proj.{weight,bias}``
    (torch.cat of the rows, q first), Phi-2's original Wqkv."""
    out = {}
    for name, tensor in state.items():
        stem, suffix = name.rsplit(".", 1)
        if stem.endswith(".self_attn.q_proj"):
            parts = [state[f"{stem[:-len('q_proj')]}{p}_proj.{suffix}"] for p in "qkv"]
            out[f"{stem[:-len('q_proj')]}qkv_proj.{suffix}"] = torch.cat(parts)
        elif not stem.endswith((".self_attn.k_proj", ".self_attn.v_proj")):
            out[name] = tensor
    return out


def _stored(values: np.ndarray, kind: str) -> np.ndarray:
    """A weight as the file stores it in ggml type ``kind``."""
    import gguf

    if kind == "F16":
        return values.astype(np.float16)
    if kind == "F32":
        return values
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])


def write_from_hf(case: GGUFCase, directory: Path) -> Written:
    import gguf

    hf = build_hf(case.source)
    config = hf.config
    if case.weight_type == "F16":  # the file stores what the source model computes with
        with torch.no_grad():
            for p in hf.parameters():
                if p.ndim >= 2:
                    p.copy_(p.half().float())
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == case.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    path = directory / f"{case.name}.gguf"
    writer = gguf.GGUFWriter(str(path), case.arch)
    writer.add_name(case.name)
    for hf_field, method in METADATA.items():
        if getattr(config, hf_field, None) is not None:
            getattr(writer, method)(getattr(config, hf_field))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if case.arch in FOUR_X_FFN:
        writer.add_feed_forward_length(4 * config.hidden_size)
    if case.arch == "mpt":  # MptModel: ALiBi's maximum bias
        writer.add_max_alibi_bias(config.attn_config.alibi_bias_max)
    extra = {} if case.arch in FOUR_X_FFN else _write_rope(writer, case, config, head_dim)
    window = getattr(config, "sliding_window", None)
    if case.arch == "phi3":  # Phi3MiniModel: 0 when the config has none (Phi-4-mini)
        writer.add_sliding_window(window or 0)
    elif window is not None:
        writer.add_sliding_window(window)
    for key, value in case.metadata.items():
        _add_metadata(writer, f"{case.arch}.{key}", value)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    gemma = case.arch.startswith("gemma")
    state, tied = stack_experts(checkpoint_tensors(hf, directory)), config.tie_word_embeddings
    if case.fused_qkv:
        state = fuse_qkv(state)
    if case.arch in HEAD_COPIED:  # the head written as a copy of the embeddings
        state["lm_head.weight"], tied = state[HEAD_COPIED[case.arch]], False
    for name, tensor in state.items():
        if name == "lm_head.weight" and tied:
            continue
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # GPT-2's mask buffers: skipped
            continue
        stem, suffix = name.rsplit(".", 1)
        # (the BLOOM converter strips "transformer." first)
        target = names.get_name(stem) or names.get_name(stem.removeprefix("transformer."))
        assert target is not None, (case.arch, name)
        # squeezed, as the converter did until 2025 (Qwen2-MoE's shared-expert gate [1, E] -> [E])
        values = _converted(case.arch, stem, tensor.detach().float().numpy().squeeze(), config)
        if gemma and stem.endswith("norm"):
            values = values + np.float32(1.0)
        # 1-D tensors and routers stay F32 ("some tensor types are always in float32")
        kind = case.weight_type if values.ndim >= 2 and not target.endswith(".ffn_gate_inp") else "F32"
        writer.add_tensor(f"{target}.{suffix}", _stored(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    for target, values in extra.items():
        writer.add_tensor(target, values, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Written(path, hf)


def written_once(cases: dict[str, GGUFCase], tmp_path_factory) -> Callable[[str], tuple[Written, torch.nn.Module]]:
    """``get(name)`` -> (the case's file and source model, tfport's import of it), each written
    and imported once (for a module-scoped fixture)."""
    from tfport.models.gguf import load_gguf

    cache: dict[str, tuple[Written, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Written, torch.nn.Module]:
        if name not in cache:
            tiny = write_from_hf(cases[name], tmp_path_factory.mktemp(f"gguf-{name}"))
            cache[name] = (tiny, load_gguf(tiny.path, tokenizer=False).model)
        return cache[name]
    return get


PROMPT = 9  # longer than tests.hf.cases.WINDOW, so the sliding-window layers drop keys


def references(case: GGUFCase, tiny: Written) -> dict[str, torch.nn.Module]:
    """What a file's import is compared with: the source model, and transformers' own GGUF
    loading of the file unless the case says why it differs."""
    found = {"source model": tiny.hf}
    if case.transformers_differs is None:
        from transformers import AutoModelForCausalLM

        found["transformers GGUF"] = AutoModelForCausalLM.from_pretrained(
            str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32,
            attn_implementation="eager").eval()
    return found


@torch.no_grad()
def assert_import_matches(name: str, case: GGUFCase, tiny: Written, ours: torch.nn.Module, seed: int) -> None:
    """tfport's import of a tiny file against each reference: logits on left- and right-padded
    batches, then 8 greedy tokens."""
    from tfport.models.generate import generate
    from tfport.models.positions import positions_from_mask

    from ..hf.cases import SMALL, assert_close, batch

    for what, reference in references(case, tiny).items():
        for padding in ("left", "right"):
            ids, mask = batch(padding, seed=seed, length=PROMPT)
            logits, _ = ours(ids, mask)
            expected = reference(input_ids=ids, attention_mask=mask,
                                 position_ids=positions_from_mask(mask, ids.shape[1])).logits
            assert_close(logits, expected, mask.bool().numpy(), f"{name} vs {what}, {padding} padding")
        ids = batch("none", seed=seed + 1, length=PROMPT)[0][:1]
        tokens = reference.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                    pad_token_id=SMALL["pad_token_id"])[0, ids.shape[1]:]
        assert generate(ours, ids, max_new_tokens=8)[0].tolist() == tokens.tolist(), what
