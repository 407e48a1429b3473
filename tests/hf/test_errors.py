"""What the importer refuses, and how it says so; config translation; the export entry point."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tfport.export.exporter import ExportOptions, export_checkpoint_or_preset
from tfport.models.checkpoint import save_checkpoint
from tfport.models.hf import hf_config_to_tfport, is_hf_checkpoint, load_hf_model

from .cases import batch

transformers = pytest.importorskip("transformers", reason="compared against transformers, which the "
                                   "'dev' extra installs")

WEIGHTS = "model.safetensors"


@pytest.fixture
def llama_dir(imported, tmp_path):
    """A writable copy of the tiny LLaMA checkpoint."""
    return shutil.copytree(imported("llama").directory, tmp_path / "llama")


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(directory, edit):
    tensors = load_file(str(directory / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})


# ------------------------------------------------------------------------------ refusals
def test_unknown_model_type(llama_dir):
    edit_config(llama_dir, model_type="rwkv", architectures=["RwkvForCausalLM"])
    from tfport.models.hf import ARCHITECTURES

    expected = re.escape(str(sorted(ARCHITECTURES)))  # every model type the registry imports
    assert {"bert", "gpt2", "llama", "roberta", "t5"} <= set(ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"model_type='rwkv'.*expected one of {expected}"):
        load_hf_model(llama_dir)


def test_unknown_architecture_class(llama_dir):
    edit_config(llama_dir, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForSequenceClassification'\].*LlamaForCausalLM"):
        load_hf_model(llama_dir)


def test_missing_key(llama_dir):
    edit_tensors(llama_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=re.escape(
            "missing key(s): model.layers.1.self_attn.k_proj.weight (for decoder.layers.1.attn.qkv.weight)")):
        load_hf_model(llama_dir)


def test_unexpected_key(llama_dir):
    edit_tensors(llama_dir, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}))
    with pytest.raises(ValueError, match=re.escape(
            "unexpected key(s): model.safetensors: model.layers.0.self_attn.q_norm.weight (8,)")):
        load_hf_model(llama_dir)


def test_extra_layer_is_unexpected(llama_dir):
    def add_layer(tensors):
        for key in [k for k in tensors if k.startswith("model.layers.1.")]:
            tensors[key.replace("layers.1.", "layers.2.")] = tensors[key].clone()
    edit_tensors(llama_dir, add_layer)
    with pytest.raises(ValueError, match=r"unexpected key\(s\): .*model\.layers\.2\."):
        load_hf_model(llama_dir)


def test_shape_mismatch(llama_dir):
    edit_tensors(llama_dir, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)}))
    with pytest.raises(ValueError, match=re.escape(
            "model.safetensors: model.layers.0.mlp.up_proj.weight has shape (40, 32), expected (48, 32) "
            "(for decoder.layers.0.ffn.up.weight")):
        load_hf_model(llama_dir)


def test_config_disagreeing_with_weights(llama_dir):
    edit_config(llama_dir, num_key_value_heads=4)  # the file holds 2 KV heads
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(16, 32\), expected \(32, 32\)"):
        load_hf_model(llama_dir)


def test_pickled_weights_only(llama_dir):
    (llama_dir / WEIGHTS).unlink()
    (llama_dir / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json; "
                                         r"it has \['pytorch_model\.bin'\], pickled weights"):
        load_hf_model(llama_dir)


def test_tied_copy_must_match(imported, tmp_path):
    directory = shutil.copytree(imported("gpt2").directory, tmp_path / "gpt2")
    edit_tensors(directory, lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 1}))
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from the tensor it is tied to"):
        load_hf_model(directory)
    edit_tensors(directory, lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"].clone()}))
    load_hf_model(directory)  # an equal saved copy is accepted


def test_ignored_keys_are_accepted(imported, tmp_path):
    """Buffers older checkpoints saved (GPT-2's causal mask) are listed as ignored, not unexpected."""
    directory = shutil.copytree(imported("gpt2").directory, tmp_path / "gpt2")
    edit_tensors(directory, lambda t: t.update({"transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4),
                                                "transformer.h.1.attn.masked_bias": torch.tensor(-1e4)}))
    load_hf_model(directory)


def test_legacy_bert_keys_are_accepted(imported, tmp_path):
    """transformers 4 saved the MLM decoder (a tied copy), its bias and the position_ids buffer."""
    it = imported("bert")
    directory = shutil.copytree(it.directory, tmp_path / "bert")
    edit_tensors(directory, lambda t: t.update({
        "cls.predictions.decoder.weight": t["bert.embeddings.word_embeddings.weight"].clone(),
        "cls.predictions.decoder.bias": t["cls.predictions.bias"].clone(),
        "bert.embeddings.position_ids": torch.arange(64)[None]}))
    ids, mask = batch("right", seed=23)
    torch.testing.assert_close(load_hf_model(directory)(ids, mask).logits, it.model(ids, mask).logits,
                               rtol=0, atol=0)
    edit_tensors(directory, lambda t: t.update({"cls.predictions.decoder.bias": t["cls.predictions.bias"] + 1}))
    with pytest.raises(ValueError, match=r"cls\.predictions\.decoder\.bias differs from .*cls\.predictions\.bias"):
        load_hf_model(directory)


# ------------------------------------------------------------------------- file layouts
def test_sharded_checkpoint(imported, tmp_path):
    it = imported("llama")
    it.hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model = load_hf_model(tmp_path / "sharded")
    ids, mask = batch("left", seed=21)
    torch.testing.assert_close(model(ids, mask)[0], it.model(ids, mask)[0], rtol=0, atol=0)


def test_half_precision_checkpoint_loads_as_float32(imported, tmp_path):
    copy.deepcopy(imported("mistral").hf).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_hf_model(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    stored = load_file(str(tmp_path / "bf16" / WEIGHTS))["model.layers.0.self_attn.q_proj.weight"]
    assert stored.dtype == torch.bfloat16
    torch.testing.assert_close(model.decoder.layers[0].attn.qkv.weight[:stored.shape[0]], stored.float(),
                               rtol=0, atol=0)


def test_shards_without_index(imported, tmp_path):
    imported("llama").hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    (tmp_path / "sharded" / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"safetensors shards \[.*\] but no model\.safetensors\.index\.json"):
        load_hf_model(tmp_path / "sharded")


def test_base_model_without_prefix(imported, tmp_path):
    """A BertModel-style file (no 'bert.' prefix) maps like the task model's."""
    it = imported("bert")
    it.hf.bert.save_pretrained(tmp_path / "base")
    model = load_hf_model(tmp_path / "base")
    assert model.config.pooler and not model.config.mlm_head
    ids, mask = batch("right", seed=22)
    torch.testing.assert_close(model(ids, mask).last_hidden_state, it.model(ids, mask).last_hidden_state,
                               rtol=0, atol=0)


def test_is_hf_checkpoint(imported, tmp_path):
    assert is_hf_checkpoint(imported("mpt").directory)
    assert not is_hf_checkpoint(save_checkpoint(imported("mpt").model, tmp_path / "tfport"))
    assert not is_hf_checkpoint(tmp_path)
    assert not is_hf_checkpoint(tmp_path / "absent")


def test_export_entry_point_takes_hf_directory(imported, tmp_path):
    """``tfport export DIR`` imports an HF directory and ships its tokenizer.json."""
    from tokenizers import Tokenizer, models

    directory = shutil.copytree(imported("bloom").directory, tmp_path / "bloom")
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(directory / "tokenizer.json"))
    manifest = export_checkpoint_or_preset(str(directory), tmp_path / "out", ExportOptions(validate=False))
    assert manifest.config.position == "alibi" and manifest.tokenizer == "tokenizer.json"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------- config translation
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=100)


def test_llama_config_legacy_rope_fields():
    """transformers 4 wrote rope_theta and rope_scaling at the top level."""
    config = hf_config_to_tfport({**LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (config.rope.theta, config.rope.scaling, config.rope.scaling_factor) == (5e5, "linear", 4.0)
    assert (config.n_kv_heads, config.norm, config.gated_ffn, config.tie_embeddings) == (2, "rmsnorm", True, False)


@pytest.mark.parametrize("rope", [{"rope_type": "su", "factor": 4.0},
                                  {"rope_type": "proportional", "factor": 2.0}])
def test_other_rope_types_are_refused(rope):
    with pytest.raises(ValueError, match=rf"rope_type='{rope['rope_type']}' is not supported"):
        hf_config_to_tfport({**LLAMA, "rope_parameters": rope})


def test_mistral_sliding_window_is_kept_in_the_graph():
    """The window is the attention's (every layer), not a cap on max_positions."""
    config = hf_config_to_tfport({**LLAMA, "model_type": "mistral", "max_position_embeddings": 32768,
                                  "sliding_window": 4096})
    assert (config.max_positions, config.window.size, config.window.layers) == (32768, 4096, None)


def test_llama3_rope_both_config_generations():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    new = hf_config_to_tfport({**LLAMA, "rope_parameters": {**llama3, "rope_theta": 5e5}})
    old = hf_config_to_tfport({**LLAMA, "rope_theta": 5e5, "rope_scaling": llama3})
    assert new == old
    assert (new.rope.scaling, new.rope.scaling_factor, new.rope.original_max_positions, new.rope.theta) == \
        ("llama3", 8.0, 8192, 5e5)


def test_llama3_rope_without_its_fields_is_refused():
    with pytest.raises(ValueError, match=r"rope_type 'llama3' needs \['original_max_position_embeddings'\]"):
        hf_config_to_tfport({**LLAMA, "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0}})


def test_token_ids_fit_tfport():
    config = hf_config_to_tfport({**LLAMA, "eos_token_id": [2, 7], "bos_token_id": 500, "pad_token_id": None})
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (2, None, 2)


@pytest.mark.parametrize("hf,message", [
    (dict(model_type="mpt", d_model=32, n_heads=4, n_layers=1, vocab_size=10, attn_config={"clip_qkv": 6.0}),
     r"attn_config\.clip_qkv=6\.0"),
    (dict(model_type="mpt", d_model=32, n_heads=4, n_layers=1, vocab_size=10, no_bias=False), r"no_bias=False"),
    (dict(model_type="bloom", hidden_size=32, n_head=4, n_layer=1, vocab_size=10,
          apply_residual_connection_post_layernorm=True), r"apply_residual_connection_post_layernorm"),
    (dict(model_type="gpt2", n_embd=32, n_head=4, n_layer=1, vocab_size=10,
          scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx"),
    (dict(model_type="gpt2", n_embd=32, n_head=4, n_layer=1, vocab_size=10,
          activation_function="quick_gelu"), r"activation='quick_gelu'"),
    (dict(model_type="bert", hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
          intermediate_size=64, vocab_size=10, position_embedding_type="relative_key"),
     r"position_embedding_type='relative_key'"),
    ({**LLAMA, "model_type": "phi", "qk_layernorm": True}, r"qk_layernorm=True"),
])
def test_inexpressible_options_are_refused(hf, message):
    with pytest.raises(ValueError, match=message):
        hf_config_to_tfport(hf)


def test_bert_heads_follow_architecture_or_keys():
    bert = dict(model_type="bert", hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                intermediate_size=64, vocab_size=10)
    masked = hf_config_to_tfport({**bert, "architectures": ["BertForMaskedLM"]})
    assert (masked.pooler, masked.mlm_head) == (False, True)
    no_pooler = hf_config_to_tfport({**bert, "architectures": ["BertModel"]},
                                    keys=["embeddings.word_embeddings.weight"])
    assert (no_pooler.pooler, no_pooler.mlm_head) == (False, False)


@pytest.mark.parametrize("model_type,pattern,expected", [
    ("gemma2", None, (0, 2)), ("gemma3_text", 3, (0, 1, 3)), ("gemma3_text", None, (0, 1, 2, 3))])
def test_gemma_windows_without_layer_types(model_type, pattern, expected):
    """Checkpoints written before transformers' layer_types: Gemma 2 alternates (even layers
    slide), Gemma 3 slides all but every sliding_window_pattern-th layer (default 6)."""
    hf = {**LLAMA, "model_type": model_type, "num_hidden_layers": 4, "sliding_window": 8, "head_dim": 16}
    if pattern is not None:
        hf["sliding_window_pattern"] = pattern
    config = hf_config_to_tfport(hf)
    assert config.window.size == 8
    assert (config.window.layers or tuple(range(4))) == expected


def test_gemma3_legacy_rope_fields():
    """Gemma 3 configs before per-layer-type rope_parameters: global rope_theta and rope_scaling,
    local rope_local_base_freq."""
    hf = {**LLAMA, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8, "rope_theta": 1e6,
          "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = hf_config_to_tfport(hf)
    assert (config.rope.theta, config.rope.scaling, config.rope.scaling_factor, config.rope.local_theta) == \
        (1e6, "linear", 8.0, 1e4)


# Fields whose absence (or legacy value) transformers' config classes resolve in their own way:
# tfport's translation must land where transformers' resolved config does.
def _resolved(cls: str, hf: dict):
    """transformers' config class built from a copy of ``hf`` (it rewrites nested dicts in place)."""
    return getattr(transformers, cls)(**{k: v for k, v in copy.deepcopy(hf).items() if k != "model_type"})


def test_gemma1_legacy_gelu_is_the_tanh_approximation():
    hf = {**LLAMA, "model_type": "gemma", "head_dim": 16, "hidden_act": "gelu"}
    assert _resolved("GemmaConfig", hf).hidden_act == "gelu_pytorch_tanh"
    tanh = hf_config_to_tfport({**hf, "hidden_act": "gelu_pytorch_tanh"}).activation
    assert hf_config_to_tfport(hf).activation == tanh != hf_config_to_tfport({**LLAMA, "hidden_act": "gelu"}).activation


@pytest.mark.parametrize("model_type,cls", [("gemma2", "Gemma2Config"), ("gemma3_text", "Gemma3TextConfig")])
def test_gemma_scale_and_softcaps_left_out_take_transformers_defaults(model_type, cls):
    hf = {**LLAMA, "model_type": model_type, "head_dim": 16, "sliding_window": 8}
    resolved, config = _resolved(cls, hf), hf_config_to_tfport(hf)
    assert config.attention_scale == pytest.approx(resolved.query_pre_attn_scalar ** -0.5)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == \
        (resolved.attn_logit_softcapping, resolved.final_logit_softcapping)
    if model_type == "gemma2":
        assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)


@pytest.mark.parametrize("model_type,cls", [("gpt_neox", "GPTNeoXConfig"), ("stablelm", "StableLmConfig")])
def test_partial_rotary_left_out_takes_transformers_default(model_type, cls):
    hf = {**LLAMA, "model_type": model_type}
    factor = _resolved(cls, hf).rope_parameters["partial_rotary_factor"]
    config = hf_config_to_tfport(hf)
    assert factor == 0.25 and config.rotary_channels == int(factor * config.dim_per_head)


def test_phi_and_starcoder2_defaults_are_transformers():
    """Fields a config.json may leave out: Phi's partial rotary factor (half of each head), its
    untied head; StarCoder2's KV head count, bias, tied head and activation."""
    hf = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    phi = _resolved("PhiConfig", {**hf, "model_type": "phi"})
    config = hf_config_to_tfport({**hf, "model_type": "phi"})
    assert config.rotary_channels == int(phi.rope_parameters["partial_rotary_factor"] * config.dim_per_head)
    assert config.tie_embeddings == phi.tie_word_embeddings and config.kv_heads == phi.num_key_value_heads
    starcoder2 = _resolved("Starcoder2Config", {**hf, "model_type": "starcoder2"})
    config = hf_config_to_tfport({**hf, "model_type": "starcoder2"})
    assert (config.kv_heads, config.attention_bias, config.tie_embeddings) == (
        starcoder2.num_key_value_heads, starcoder2.use_bias, starcoder2.tie_word_embeddings)
    assert config.activation == hf_config_to_tfport({**hf, "model_type": "starcoder2",
                                                     "hidden_act": starcoder2.hidden_act}).activation


def test_a_llama_config_with_a_sliding_window_has_none():
    """transformers' Llama never reads sliding_window (Mistral does)."""
    assert hf_config_to_tfport({**LLAMA, "sliding_window": 4}).window.size is None
    assert hf_config_to_tfport({**LLAMA, "model_type": "mistral", "sliding_window": 4}).window.size == 4


def test_phi3_original_length_is_the_top_level_field():
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 8,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for top in ({}, {"original_max_position_embeddings": 16}):
        hf = {**LLAMA, "model_type": "phi3", "max_position_embeddings": 64, "rope_parameters": dict(rope), **top}
        expected = _resolved("Phi3Config", hf).rope_parameters["original_max_position_embeddings"]
        assert hf_config_to_tfport(hf).rope.original_max_positions == expected == top.get(
            "original_max_position_embeddings", 4096)


def test_roberta_masked_lm_with_another_activation_is_refused():
    hf = dict(model_type="roberta", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, vocab_size=100, hidden_act="relu", architectures=["RobertaForMaskedLM"])
    with pytest.raises(ValueError, match="hidden_act='relu'.*masked-LM head applies GELU"):
        hf_config_to_tfport(hf)
    assert hf_config_to_tfport({**hf, "architectures": ["RobertaModel"]}).activation == "relu"
