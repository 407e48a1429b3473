"""GGUF architectures tfport imports: GGUF metadata -> a Hugging Face ``config.json`` dict, and
GGUF tensor names -> Hugging Face tensor names.

Each architecture is one ``GGUFArchitecture`` entry (``entry.py``) in ``ARCHITECTURES``, keyed by
the file's ``general.architecture``: the LLaMA-layout families here, the families with their own
names and fused or transposed attention (GPT-2, BLOOM, MPT, Falcon) in ``gpt_families.py``. The Hugging Face importer (``tfport.models.hf``) then maps the HF names
onto tfport's modules and checks every key and shape, so an entry only has to say how llama.cpp
renamed things:

* ``config``: ``{arch}.<suffix>`` metadata -> HF config field;
* ``tensors``: GGUF name prefix -> HF name prefix (``{i}`` is the layer index; the ``.weight`` /
  ``.bias`` suffix is carried over);
* ``permuted``: the GGUF prefixes whose rows llama.cpp permuted for its RoPE layout, with the
  config field that holds their head count (the Q rows use the query heads, K the KV heads);
* ``added``: the GGUF prefixes to which llama.cpp's converter added a constant (Gemma's norm
  weights, stored as the multiplier 1 + w), subtracted again on import;
* ``reshaped``: the GGUF prefixes whose values the converter rearranged (a fused QKV regrouped to
  [q | k | v]), with the function that puts them back in the Hugging Face layout, given the HF
  config; ``transposed``: the prefixes stored transposed (GPT-2's Conv1D weights);
* ``alternatives``: tensor names whose presence changes the mapping (Falcon 40B's second norm),
  with the entries of ``tensors`` they replace;
* ``defaults`` / ``derived``: HF fields the file does not store, as constants or computed from
  the fields read (as llama.cpp's own loader fills them in);
* ``row_vectors``: the GGUF prefixes of HF [1, E] weights that a file may store as [E] (ggml
  ignores trailing dimensions of 1; Qwen2-MoE's shared-expert gate).

Mixture-of-experts layers: the converter stacks the experts' [out, in] projections into one
tensor [N, out, in] per layer (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``); an HF
prefix with ``{e}`` in ``tensors`` names each expert's slice, one HF tensor per expert.

RoPE scaling is read for every architecture by the loader: from ``rope.scaling.*`` (linear, YaRN)
and from the tensors ``rope_freqs`` (llama3) and ``rope_factors_long/short`` (LongRoPE), which are
settings, not weights (``ROPE_TENSORS``).

Only LLaMA's converter permutes Q/K: Qwen2/3, Gemma 1/2/3, Phi-2/3 and StarCoder2 use llama.cpp's
NeoX-style rotation, which already rotates the first half of the head against the second.

llama.cpp's converter stores Q and K rows of each head as interleaved (even, odd) pairs, the
layout of its rotary kernel; Hugging Face LLaMA rotates the first half of the head against the
second. ``unpermute_rows`` undoes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .entry import GGUFArchitecture
from .gpt_families import BLOOM, FALCON, GPT2, MPT

# GGUF architectures transformers reads that tfport's Hugging Face importer cannot map yet; an
# entry in ARCHITECTURES (and support in tfport.models.hf) lifts the refusal.
NOT_YET_SUPPORTED = ("gemma3n", "mamba", "nemotron",
                     "t5", "t5encoder", "deci", "cohere", "command-r")
# Whole-file tensors that hold RoPE settings (read into the config by the loader), not weights:
# llama3 scaling's divisor per frequency, LongRoPE's long and short factors.
LLAMA3_TENSOR = "rope_freqs.weight"
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_TENSORS = (LLAMA3_TENSOR, *LONGROPE_TENSORS)


# The LLaMA layout's metadata and tensor names, which Qwen2/3, Gemma 1/2/3 and Phi-3 share.
LLAMA_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
LLAMA_LAYER = "model.layers.{i}"
LLAMA_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": f"{LLAMA_LAYER}.input_layernorm",
    "blk.{i}.attn_q": f"{LLAMA_LAYER}.self_attn.q_proj",
    "blk.{i}.attn_k": f"{LLAMA_LAYER}.self_attn.k_proj",
    "blk.{i}.attn_v": f"{LLAMA_LAYER}.self_attn.v_proj",
    "blk.{i}.attn_output": f"{LLAMA_LAYER}.self_attn.o_proj",
    "blk.{i}.ffn_norm": f"{LLAMA_LAYER}.post_attention_layernorm",
    "blk.{i}.ffn_gate": f"{LLAMA_LAYER}.mlp.gate_proj",
    "blk.{i}.ffn_up": f"{LLAMA_LAYER}.mlp.up_proj",
    "blk.{i}.ffn_down": f"{LLAMA_LAYER}.mlp.down_proj",
}
QK_NORM_TENSORS = {"blk.{i}.attn_q_norm": f"{LLAMA_LAYER}.self_attn.q_norm",
                   "blk.{i}.attn_k_norm": f"{LLAMA_LAYER}.self_attn.k_norm"}
# Mixtures of experts: the router ffn_gate_inp [N, E] and the stacked experts (see the module doc).
MOE_CONFIG = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
              "expert_feed_forward_length": "moe_intermediate_size"}
MIXTRAL_LAYER = f"{LLAMA_LAYER}.block_sparse_moe"
MIXTRAL_TENSORS = {"blk.{i}.ffn_gate_inp": f"{MIXTRAL_LAYER}.gate",
                   "blk.{i}.ffn_gate_exps": f"{MIXTRAL_LAYER}.experts.{{e}}.w1",
                   "blk.{i}.ffn_up_exps": f"{MIXTRAL_LAYER}.experts.{{e}}.w3",
                   "blk.{i}.ffn_down_exps": f"{MIXTRAL_LAYER}.experts.{{e}}.w2"}
QWEN_MOE_TENSORS = {"blk.{i}.ffn_gate_inp": f"{LLAMA_LAYER}.mlp.gate",
                    "blk.{i}.ffn_gate_exps": f"{LLAMA_LAYER}.mlp.experts.{{e}}.gate_proj",
                    "blk.{i}.ffn_up_exps": f"{LLAMA_LAYER}.mlp.experts.{{e}}.up_proj",
                    "blk.{i}.ffn_down_exps": f"{LLAMA_LAYER}.mlp.experts.{{e}}.down_proj"}
# Qwen2-MoE's shared expert, scaled by sigmoid(ffn_gate_inp_shexp x)
QWEN2_MOE_SHARED = {"blk.{i}.ffn_gate_inp_shexp": f"{LLAMA_LAYER}.mlp.shared_expert_gate",
                    "blk.{i}.ffn_gate_shexp": f"{LLAMA_LAYER}.mlp.shared_expert.gate_proj",
                    "blk.{i}.ffn_up_shexp": f"{LLAMA_LAYER}.mlp.shared_expert.up_proj",
                    "blk.{i}.ffn_down_shexp": f"{LLAMA_LAYER}.mlp.shared_expert.down_proj"}
# A dense architecture's metadata with experts: llama.cpp writes MoE models under their own
# architecture names, so such a file is not one it makes.
MOE_REFUSED = {"expert_count": "a file of this dense architecture with experts is not a layout "
                               "llama.cpp writes (its MoE files are 'qwen2moe' / 'qwen3moe')"}


def llama_variant(config: dict[str, Any], names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What a ``llama`` file is: with experts (``expert_count``), Mixtral (transformers' Mixtral
    has the window, if any, on every layer); with a sliding window, Mistral (transformers' Llama
    has no window, its Mistral one on every layer or the layers ``layer_types`` names)."""
    if config.get("num_local_experts"):
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    if config.get("sliding_window"):
        return {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    return {}


# LLaMA, Mistral and Mixtral: llama.cpp's converter writes all three as "llama". Mixtral's
# feed_forward_length is each expert's width (its intermediate_size); routing: softmax over the
# experts, top expert_used_count, renormalised (llama.cpp's and transformers' Mixtral).
LLAMA = GGUFArchitecture(
    name="llama",
    model_type="llama",
    hf_class="LlamaForCausalLM",
    config={**LLAMA_CONFIG, "attention.sliding_window": "sliding_window",
            "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    tensors={**LLAMA_TENSORS, **MIXTRAL_TENSORS},
    permuted={"blk.{i}.attn_q": "num_attention_heads", "blk.{i}.attn_k": "num_key_value_heads"},
    defaults={"hidden_act": "silu"},
    derived=llama_variant,
)

# Qwen2/2.5: biases on q/k/v (the HF importer always expects them); no sliding window in the
# metadata (Qwen2 configs ship use_sliding_window: false).
QWEN2 = GGUFArchitecture(
    name="qwen2", model_type="qwen2", hf_class="Qwen2ForCausalLM", config=LLAMA_CONFIG,
    tensors=LLAMA_TENSORS, defaults={"hidden_act": "silu"}, refused=MOE_REFUSED)

# Qwen3: per-head RMSNorm on queries and keys; head_dim from attention.key_length (128 in every
# Qwen3, not hidden / heads).
QWEN3 = GGUFArchitecture(
    name="qwen3", model_type="qwen3", hf_class="Qwen3ForCausalLM", config=LLAMA_CONFIG,
    tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS}, defaults={"hidden_act": "silu"},
    refused=MOE_REFUSED)


def qwen2_moe_bias(config: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """Qwen2-MoE's q/k/v biases (``qkv_bias``), which GGUF says by the tensors present."""
    return {"qkv_bias": "blk.0.attn_q.bias" in names}


# Qwen1.5-MoE / Qwen2-MoE: every layer a mixture (llama.cpp's qwen2moe has no dense layers),
# experts of width expert_feed_forward_length, a sigmoid-gated shared expert of width
# expert_shared_feed_forward_length; top-k weights not renormalised (llama.cpp's qwen2moe, as
# the released configs' norm_topk_prob false).
QWEN2MOE = GGUFArchitecture(
    name="qwen2moe", model_type="qwen2_moe", hf_class="Qwen2MoeForCausalLM",
    config={**LLAMA_CONFIG, **MOE_CONFIG,
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    tensors={**LLAMA_TENSORS, **QWEN_MOE_TENSORS, **QWEN2_MOE_SHARED},
    defaults={"hidden_act": "silu", "norm_topk_prob": False}, derived=qwen2_moe_bias,
    row_vectors=("blk.{i}.ffn_gate_inp_shexp",))

# Qwen3-MoE: Qwen3's attention (q/k norms, attention.key_length), every layer a mixture, top-k
# weights renormalised (llama.cpp's qwen3moe; the converter writes no key for it).
QWEN3MOE = GGUFArchitecture(
    name="qwen3moe", model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
    config={**LLAMA_CONFIG, **MOE_CONFIG},
    tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS, **QWEN_MOE_TENSORS},
    defaults={"hidden_act": "silu", "norm_topk_prob": True})

# OLMoE: q/k norms over all heads' channels (attn_q_norm [H*D]), q/k/v clamped where
# attention.clamp_kqv says; every layer a mixture of feed_forward_length-wide experts (the HF
# config's intermediate_size), top-k weights not renormalised (llama.cpp's olmoe).
OLMOE = GGUFArchitecture(
    name="olmoe", model_type="olmoe", hf_class="OlmoeForCausalLM",
    config={**LLAMA_CONFIG, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
            "attention.clamp_kqv": "clip_qkv"},
    tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS, **QWEN_MOE_TENSORS},
    defaults={"hidden_act": "silu", "norm_topk_prob": False})

# Gemma: llama.cpp's converter stores every RMSNorm weight w as the multiplier 1 + w (and drops
# Gemma 1/2's lm_head, a copy of the embeddings).
GEMMA_NORMS = ("output_norm", "blk.{i}.attn_norm", "blk.{i}.ffn_norm", "blk.{i}.post_attention_norm",
               "blk.{i}.post_ffw_norm", "blk.{i}.attn_q_norm", "blk.{i}.attn_k_norm")
GEMMA2_TENSORS = {**LLAMA_TENSORS,
                  # Gemma 2/3: norms before and after each sublayer
                  "blk.{i}.post_attention_norm": f"{LLAMA_LAYER}.post_attention_layernorm",
                  "blk.{i}.ffn_norm": f"{LLAMA_LAYER}.pre_feedforward_layernorm",
                  "blk.{i}.post_ffw_norm": f"{LLAMA_LAYER}.post_feedforward_layernorm"}
# llama.cpp's gelu is the tanh approximation, as Gemma's configs ask.
GEMMA_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh"}
# The model (by layer count, as llama.cpp's loader tells them apart) whose
# query_pre_attn_scalar is hidden / heads; every other Gemma 2/3 uses head_dim.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def gemma_query_scalar(config: dict[str, Any], names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Gemma 2/3's ``query_pre_attn_scalar``, which GGUF does not store: llama.cpp scales queries
    by head_dim^-1/2, except in the 27B models, by (hidden / heads)^-1/2 (144 and 168, the values
    of their HF configs)."""
    per_head = config["hidden_size"] // config["num_attention_heads"]
    if config.get("num_hidden_layers") == GEMMA_27B_LAYERS[config["model_type"]]:
        return {"query_pre_attn_scalar": per_head}
    return {"query_pre_attn_scalar": config.get("head_dim", per_head)}


def _gemma(name: str, model_type: str, hf_class: str, config: dict[str, str],
           tensors: dict[str, str], defaults: dict[str, object], derived=None) -> GGUFArchitecture:
    return GGUFArchitecture(
        name=name, model_type=model_type, hf_class=hf_class, config={**LLAMA_CONFIG, **config},
        tensors=tensors, added={prefix: 1.0 for prefix in GEMMA_NORMS if prefix in tensors},
        defaults={**GEMMA_DEFAULTS, **defaults}, derived=derived)


GEMMA = _gemma("gemma", "gemma", "GemmaForCausalLM", {}, LLAMA_TENSORS, {})
# Gemma 2: soft-capping (llama.cpp's defaults 50 / 30 when absent), sliding windows on every
# other layer (the HF importer's default pattern, as llama.cpp's) unless
# attention.sliding_window_pattern says otherwise (read by the loader for every architecture).
GEMMA2 = _gemma("gemma2", "gemma2", "Gemma2ForCausalLM",
                {"attention.sliding_window": "sliding_window",
                 "attn_logit_softcapping": "attn_logit_softcapping",
                 "final_logit_softcapping": "final_logit_softcapping"},
                GEMMA2_TENSORS, {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                derived=gemma_query_scalar)
# Gemma 3 (text): q/k norms, one global layer in 6 (the HF importer's default pattern, as
# llama.cpp's); rope.freq_base is the global layers' base, rope.freq_base_swa the sliding
# layers' (10000 when absent: llama.cpp's and the HF importer's default); rope.scaling (linear,
# factor 8 in 4B+) applies to the global layers only.
GEMMA3 = _gemma("gemma3", "gemma3_text", "Gemma3ForCausalLM",
                {"attention.sliding_window": "sliding_window",
                 "rope.freq_base_swa": "rope_local_base_freq"},
                {**GEMMA2_TENSORS, **QK_NORM_TENSORS}, {}, derived=gemma_query_scalar)

# Phi-3: the converter keeps the fused qkv_proj (attn_qkv) and gate_up_proj (ffn_up) as they are;
# the window applies to every layer; a window of 0 (Phi-4-mini's files) means none. LongRoPE's
# factors (128k models) are the tensors rope_factors_long/short, read by the loader.
PHI3 = GGUFArchitecture(
    name="phi3", model_type="phi3", hf_class="Phi3ForCausalLM",
    config={**LLAMA_CONFIG, "attention.sliding_window": "sliding_window"},
    tensors={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "blk.{i}.attn_norm": f"{LLAMA_LAYER}.input_layernorm",
             "blk.{i}.attn_qkv": f"{LLAMA_LAYER}.self_attn.qkv_proj",
             "blk.{i}.attn_output": f"{LLAMA_LAYER}.self_attn.o_proj",
             "blk.{i}.ffn_norm": f"{LLAMA_LAYER}.post_attention_layernorm",
             "blk.{i}.ffn_up": f"{LLAMA_LAYER}.mlp.gate_up_proj",
             "blk.{i}.ffn_down": f"{LLAMA_LAYER}.mlp.down_proj"},
    defaults={"hidden_act": "silu"},
)


def stablelm_layout(config: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """StableLM's q/k/v biases and parallel residual, which GGUF says by the tensors present (a
    parallel block has no ffn_norm: both branches read attn_norm's output)."""
    return {"use_qkv_bias": "blk.0.attn_q.bias" in names,
            "use_parallel_residual": "blk.0.ffn_norm.weight" not in names}


def layernorm_config(eps_field: str) -> dict[str, str]:
    """``LLAMA_CONFIG`` for a family with LayerNorms: attention.layer_norm_epsilon -> the HF
    config's ``eps_field`` instead of the RMSNorm epsilon."""
    return {**{k: v for k, v in LLAMA_CONFIG.items() if k != "attention.layer_norm_rms_epsilon"},
            "attention.layer_norm_epsilon": eps_field}


# StableLM: LayerNorm (weights and biases), partial rotary (rope.dimension_count).
STABLELM = GGUFArchitecture(
    name="stablelm", model_type="stablelm", hf_class="StableLmForCausalLM",
    config=layernorm_config("layer_norm_eps"),
    tensors=LLAMA_TENSORS, defaults={"hidden_act": "silu"}, derived=stablelm_layout,
)


def phi2_rotary(config: dict[str, Any], names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """llama.cpp rotates rope.dimension_count channels of each head, the whole head when the key
    is absent or equal to it (the loader then sets no partial_rotary_factor); transformers' Phi
    would default to half of the head, so whole heads are said."""
    return {"partial_rotary_factor": config.get("partial_rotary_factor", 1.0)}


# Phi-2: one LayerNorm feeding attention and MLP in parallel (no ffn_norm), biases everywhere
# including the head (output.bias), partial rotary (rope.dimension_count; the converter writes no
# rope.freq_base: llama.cpp's 10000). The converter renames transformers' q/k/v_proj to
# attn_q/k/v; files converted from Phi-2's original layout (mixer.Wqkv) hold one fused attn_qkv
# ([q | k | v] rows), which the HF importer's Phi takes as self_attn.qkv_proj.
PHI2 = GGUFArchitecture(
    name="phi2", model_type="phi", hf_class="PhiForCausalLM", config=layernorm_config("layer_norm_eps"),
    tensors={**{k: v for k, v in LLAMA_TENSORS.items() if k not in ("blk.{i}.ffn_norm", "blk.{i}.ffn_gate")},
             "output_norm": "model.final_layernorm",
             "blk.{i}.attn_qkv": f"{LLAMA_LAYER}.self_attn.qkv_proj",
             "blk.{i}.attn_output": f"{LLAMA_LAYER}.self_attn.dense",
             "blk.{i}.ffn_up": f"{LLAMA_LAYER}.mlp.fc1", "blk.{i}.ffn_down": f"{LLAMA_LAYER}.mlp.fc2"},
    defaults={"hidden_act": "gelu_new"}, derived=phi2_rotary,
)


def starcoder2_bias(config: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """StarCoder2's ``use_bias`` (every projection), which GGUF says by the tensors present."""
    return {"use_bias": "blk.0.attn_q.bias" in names}


# StarCoder2: LLaMA's names with LayerNorms and a plain c_fc / c_proj MLP (ffn_up / ffn_down, no
# ffn_gate), tied head unless output is stored. The converter writes no sliding window and
# llama.cpp's starcoder2 attends to the whole context, so an imported file has no window either.
STARCODER2 = GGUFArchitecture(
    name="starcoder2", model_type="starcoder2", hf_class="Starcoder2ForCausalLM",
    config=layernorm_config("norm_epsilon"),
    tensors={**{k: v for k, v in LLAMA_TENSORS.items() if k != "blk.{i}.ffn_gate"},
             "blk.{i}.ffn_up": f"{LLAMA_LAYER}.mlp.c_fc", "blk.{i}.ffn_down": f"{LLAMA_LAYER}.mlp.c_proj"},
    defaults={"hidden_act": "gelu_pytorch_tanh"}, derived=starcoder2_bias,
)

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    arch.name: arch for arch in (LLAMA, QWEN2, QWEN3, QWEN2MOE, QWEN3MOE, OLMOE, GEMMA, GEMMA2,
                                 GEMMA3, PHI3, STABLELM, PHI2, STARCODER2, GPT2, BLOOM, MPT, FALCON)}


def architecture(name: str, origin: str) -> GGUFArchitecture:
    """The entry for ``general.architecture`` = ``name``; a clear error otherwise."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    if name in NOT_YET_SUPPORTED:
        raise ValueError(f"{origin}: GGUF architecture {name!r} is not supported yet (tfport's "
                         f"Hugging Face importer does not map it); supported: {sorted(ARCHITECTURES)}")
    raise ValueError(f"{origin}: unknown GGUF architecture {name!r}; tfport imports "
                     f"{sorted(ARCHITECTURES)}")


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order of a Q or K weight [H*D, E] (or bias [H*D]).

    Within each head llama.cpp stores rows as (0, D/2), (1, D/2 + 1), ... pairs: viewed as
    [H, D/2, 2, ...] its row (h, j, p) is Hugging Face's row (h, p, j). Swapping those two axes
    back gives [H, 2, D/2, ...], i.e. the first half of the head, then the second.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads: each head needs an "
                         "even number of rows")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
