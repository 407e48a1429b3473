"""GGUF mixture-of-experts files, one tiny file per architecture (written from a tiny transformers
MoE model by ``from_hf``, the experts stacked as llama.cpp's converter stacks them): Mixtral
(``llama`` with ``llama.expert_count``), Qwen2-MoE (``qwen2moe``, a gated shared expert),
Qwen3-MoE (``qwen3moe``) and OLMoE (``olmoe``). Each is imported and compared with the source
model and, where it can read the file, transformers' own GGUF loading (logits of a left- and a
right-padded batch, greedy tokens), and exported through ONNX Runtime (portable target) against the source model's greedy
tokens; ``--quantize keep`` keeps the experts' Q8_0 / Q4_0 blocks; refusals name the file and the
metadata key.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tfport.config.moe import MoeConfig
from tfport.export import ExportOptions, export_checkpoint_or_preset
from tfport.export.quant import KeptQuantization
from tfport.models.gguf import load_gguf, read_gguf
from tfport.runtime import load_model

from ..hf.cases import HFCase
from ..hf.test_decoders import _hf_greedy
from .from_hf import PROMPT, GGUFCase, assert_import_matches, write_from_hf, written_once
from .test_tiny import encoder
from .tiny import write_tiny_llama

# 4 experts, 2 per token; widths multiples of 32 so that the block types can store every weight.
_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_experts_per_tok=2)
_MIXTRAL = HFCase("mixtral", "MixtralForCausalLM", "MixtralConfig", dict(
    _MOE, intermediate_size=64, num_local_experts=4), seed=60)
# transformers' GGUF loader does not read {arch}.expert_feed_forward_length nor
# expert_shared_feed_forward_length: it keeps its config defaults (Qwen1.5-MoE-A2.7B's 1408 / 5632,
# Qwen3-30B-A3B's 768), which the Qwen cases use.
# llama.cpp's qwen2moe: every layer a mixture, top-k weights not renormalised; a shared expert.
_QWEN2_MOE = HFCase("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
    _MOE, intermediate_size=96, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
    num_experts=4, norm_topk_prob=False), seed=61)
# llama.cpp's qwen3moe: renormalised top k.
_QWEN3_MOE = HFCase("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
    _MOE, head_dim=16, intermediate_size=96, moe_intermediate_size=768, num_experts=4,
    norm_topk_prob=True), seed=62)
# OLMoE: q/k norms over all heads, q/k/v clamped (attention.clamp_kqv: the converter writes none
# for OLMoE, whose release has no clamp; read when present); top 2 not renormalised.
_OLMOE = HFCase("olmoe", "OlmoeForCausalLM", "OlmoeConfig", dict(
    _MOE, intermediate_size=32, num_experts=4, clip_qkv=1.5), seed=63)
MIXTRAL_DIFFERS = ("transformers' GGUF loader reads a 'llama' file with experts as a dense Llama, "
                   "its MLP weights left randomly initialised (a warning, no error)")

CASES = {case.name: case for case in [
    GGUFCase("mixtral", "llama", _MIXTRAL, transformers_differs=MIXTRAL_DIFFERS),
    GGUFCase("qwen2moe", "qwen2moe", _QWEN2_MOE, weight_type="F16"),
    GGUFCase("qwen3moe", "qwen3moe", _QWEN3_MOE),
    GGUFCase("olmoe", "olmoe", _OLMOE, metadata={"attention.clamp_kqv": 1.5},
             transformers_differs="transformers' GGUF loader has no 'olmoe' architecture"),
]}
# Block-type files for --quantize keep (routers stay F32, as llama.cpp's converter keeps them),
# compared with their import only: widths need only be multiples of 32.
KEEP_CASES = {case.name: case for case in [
    GGUFCase("mixtral-q8_0", "llama", _MIXTRAL, weight_type="Q8_0"),
    GGUFCase("qwen2moe-q4_0", "qwen2moe", replace(_QWEN2_MOE, fields=dict(
        _QWEN2_MOE.fields, moe_intermediate_size=32, shared_expert_intermediate_size=64)), weight_type="Q4_0"),
]}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``written(name)`` -> (Written, tfport module), once per module."""
    return written_once(CASES, tmp_path_factory)


@pytest.mark.parametrize("name", sorted(CASES))
def test_file_holds_stacked_experts(written, name):
    """The experts are stacked [N, out, in] per layer, and each HF expert tensor is its slice."""
    tiny, _ = written(name)
    _, _, _, tensors = read_gguf(tiny.path)
    moe_block = "block_sparse_moe.experts.3.w2" if name == "mixtral" else "mlp.experts.3.down_proj"
    hf_name = f"model.layers.1.{moe_block}.weight"
    assert tensors.where(hf_name) == f"{tiny.path.name}: blk.1.ffn_down_exps.weight[3] ({CASES[name].weight_type})"
    layer = tiny.hf.model.layers[1].mlp.experts  # transformers 5: down_proj [N, E, F]
    torch.testing.assert_close(tensors.get(hf_name), layer.down_proj[3].detach(), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_matches(written, name):
    assert_import_matches(name, CASES[name], *written(name), seed=63)


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_config_from_metadata(written, name):
    """Experts, experts per token, widths and llama.cpp's routing of each architecture."""
    tiny, ours = written(name)
    hf = tiny.hf.config
    n_experts = getattr(hf, "num_local_experts", None) or hf.num_experts
    width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
    # the source configs route as llama.cpp does (Mixtral always renormalises)
    assert ours.config.moe == MoeConfig(n_experts=n_experts, top_k=hf.num_experts_per_tok, d_expert=width,
                                        routing="softmax_topk", normalize=getattr(hf, "norm_topk_prob", True),
                                        shared_d_ff=shared, shared_gate=shared > 0)


@pytest.mark.parametrize("name", sorted(CASES))
@torch.no_grad()
def test_export_runs_on_onnx_runtime(written, name, tmp_path):
    """``tfport export FILE.gguf`` (portable target; the export validates itself against the
    import) and the runtime's greedy tokens on a ragged batch are the source model's."""
    tiny, _ = written(name)
    export_checkpoint_or_preset(str(tiny.path), tmp_path / "out", ExportOptions(target="portable"))
    prompts = [list(range(5, 5 + PROMPT)), list(range(40, 40 + PROMPT - 2))]
    tokens = load_model(tmp_path / "out").generate(prompts, max_new_tokens=6, stop_token_ids=())
    expected = _hf_greedy(SimpleNamespace(hf=tiny.hf, case=CASES[name].source), prompts, 6)
    np.testing.assert_array_equal(tokens, expected, err_msg=name)


@pytest.mark.parametrize("name", sorted(KEEP_CASES))
def test_keep_keeps_the_experts_blocks(name, tmp_path):
    """``--quantize keep`` on a Q8_0 / Q4_0 MoE file: every expert's product is lowered with the
    file's own blocks; only the F32 matrices (routers and Qwen2-MoE's shared-expert gate, as in
    llama.cpp's files) are re-quantised. The export validates itself against the import."""
    case = KEEP_CASES[name]
    tiny = write_from_hf(case, tmp_path)
    manifest = export_checkpoint_or_preset(str(tiny.path), tmp_path / "k",
                                           ExportOptions(target="portable", quantize=KeptQuantization(tiny.path)))
    config = tiny.hf.config
    layers, n_experts = config.num_hidden_layers, getattr(config, "num_local_experts", None) or config.num_experts
    shared = case.arch == "qwen2moe"
    # kept per layer: QKV, output, each expert's gate|up and down (and the shared expert's); the
    # untied table and head. Re-quantised per layer: the router (and the shared expert's gate).
    kept, requantized = layers * (2 + 2 * n_experts + 2 * shared) + 2, layers * (1 + shared)
    quantization = manifest.quantization
    assert (quantization["kept"], quantization["requantized"]) == (kept, requantized)
    assert quantization["types"] == [case.weight_type]


# ------------------------------------------------------------------------------------ refusals
def test_refuses_experts_in_a_dense_architecture(tmp_path):
    """llama.cpp writes Qwen MoE models as qwen2moe / qwen3moe, never as qwen2 with experts."""
    tiny = write_tiny_llama(tmp_path / "qwen2-experts.gguf", encoder(0), "F32", architecture="qwen2",
                            extra_metadata={"qwen2.expert_count": 4})
    with pytest.raises(ValueError, match=r"qwen2-experts\.gguf: qwen2\.expert_count=4 is not supported"):
        read_gguf(tiny.path)


def test_missing_experts_per_token_names_the_key(tmp_path):
    case = GGUFCase("no-used-count", "llama", _MIXTRAL, metadata={"expert_used_count": None})
    tiny = write_from_hf(case, tmp_path)
    with pytest.raises(ValueError, match=r"no-used-count\.gguf: metadata llama\.expert_used_count"):
        load_gguf(tiny.path, tokenizer=False)


def test_refuses_the_old_per_expert_layout(tmp_path):
    """Mixtral files converted before llama.cpp stacked the experts hold one 2-D tensor per expert
    (blk.N.ffn_gate.E.weight): refused as unmapped tensors, named."""
    per_expert = np.zeros((256, 256), dtype=np.float32)
    tiny = write_tiny_llama(tmp_path / "old-mixtral.gguf", encoder(0), "F32",
                            extra_metadata={"llama.expert_count": 4},
                            extra_tensors={"blk.0.ffn_gate.0.weight": ("F32", per_expert)})
    old = r"\['blk\.0\.ffn_gate\.0\.weight \[256, 256\]'\]"
    with pytest.raises(ValueError, match=rf"old-mixtral\.gguf: tensor\(s\) {old} have no counterpart"):
        read_gguf(tiny.path)
