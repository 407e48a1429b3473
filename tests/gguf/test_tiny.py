"""Tiny GGUF files written in the test, one per ggml type tfport reads: dequantisation against an
independent reference, names and Q/K un-permutation, and the whole import against transformers
loading the same file; refusals of unknown architectures, types and tensors.

How each type's bytes are made and what its dequantisation is checked against (``CASES``):
gguf-py's ``quantize`` implements the float and legacy block types; for the K-quants
(Q2_K..Q6_K) it raises NotImplementedError, so those files hold random blocks with sane fp16
scales, and their values are checked against transformers' own torch dequantiser
(``transformers.integrations.gguf.dequant``), a separate implementation of the same format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tfport.models.gguf import SUPPORTED_TYPES, GGUFFile, load_gguf, read_gguf

from .tiny import HKV, K_BLOCKS, H, permute_rows, random_super_blocks, write_tiny_llama

GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
                 "Q6_K": 14}


@dataclass(frozen=True)
class Case:
    encode: str     # "quantize": gguf.quants.quantize; "random": random K-quant blocks
    reference: str  # what the dequantised values are compared with (see _check_values)
    bound: float = 0.0  # "error bound": max |error| as a fraction of the block's value range


CASES = {
    "F32": Case("quantize", "exact"),
    "F16": Case("quantize", "float16"),
    "BF16": Case("quantize", "bfloat16"),
    "Q8_0": Case("quantize", "transformers"),
    "Q4_0": Case("quantize", "transformers"),
    "Q4_1": Case("quantize", "transformers"),
    # transformers' torch dequantiser has no Q5_0 / Q5_1: the error against the original values
    # must stay within one quantisation step of each 32-value block (range / 31 for 5 bits).
    "Q5_0": Case("quantize", "error bound", 2 / 31),
    "Q5_1": Case("quantize", "error bound", 1 / 31),
    **{kind: Case("random", "transformers") for kind in K_BLOCKS},
}


def encoder(seed: int):
    rng = np.random.default_rng(seed)

    def encode(values: np.ndarray, kind: str) -> np.ndarray:
        import gguf

        if CASES[kind].encode == "quantize":
            return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        return random_super_blocks(kind, values.shape, rng)
    return encode


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """``tiny_files(kind)`` -> TinyGGUF, written once per module."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"gguf-{kind}") / f"tiny-{kind}.gguf"
            cache[kind] = write_tiny_llama(path, encoder(1), kind, tied=kind in ("Q4_1", "Q6_K"))
        return cache[kind]
    return get


def test_every_supported_type_has_a_case():
    assert set(CASES) == set(SUPPORTED_TYPES)


def _check_values(kind: str, got: np.ndarray, original: np.ndarray, stored: np.ndarray) -> None:
    case = CASES[kind]
    if case.reference == "exact":
        np.testing.assert_array_equal(got, original)
    elif case.reference == "float16":
        np.testing.assert_array_equal(got, original.astype(np.float16).astype(np.float32))
    elif case.reference == "bfloat16":
        expected = torch.from_numpy(original).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got, expected)
    elif case.reference == "transformers":
        from transformers.integrations.gguf.dequant import dequantize

        expected = dequantize(torch.from_numpy(np.ascontiguousarray(stored)).reshape(-1),
                              GGML_TYPE_IDS[kind]).reshape(got.shape).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    else:  # error bound per 32-value block
        blocks, values = got.reshape(-1, 32), original.reshape(-1, 32)
        span = values.max(axis=1) - np.minimum(values.min(axis=1), 0) + 1e-6
        err = np.abs(blocks - values).max(axis=1)
        assert (err <= case.bound * span * 1.01).all(), (err / span).max()


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_dequantisation(tiny_files, kind):
    tiny = tiny_files(kind)
    file = GGUFFile(tiny.path)
    assert file.tensor_type("blk.0.attn_q.weight") == kind
    assert file.tensor_type("blk.0.attn_norm.weight") == "F32"
    originals = {f"{name}": values for name, values in tiny.weights.items()}
    _, _, _, tensors = read_gguf(tiny.path)
    for hf_name in tensors.keys():
        gguf_name = tensors.where(hf_name).split(": ", 1)[1].split(" ", 1)[0]
        stored_kind, stored = tiny.stored[gguf_name]
        original = originals[hf_name]
        if "q_proj" in hf_name or "k_proj" in hf_name:  # compare in the file's (permuted) order
            original = permute_rows(original, H if "q_proj" in hf_name else HKV)
        got = file.dequantize(gguf_name)
        assert got.dtype == np.float32 and got.shape == original.shape
        _check_values(stored_kind, got, original, stored)


def test_names_and_unpermutation(tiny_files):
    """F32 file: every Hugging Face tensor comes back exactly, Q and K in Hugging Face order."""
    tiny = tiny_files("F32")
    _, _, config, tensors = read_gguf(tiny.path)
    assert set(tensors.keys()) == set(tiny.weights)
    for name, values in tiny.weights.items():
        np.testing.assert_array_equal(tensors.get(name).numpy(), values, err_msg=name)
    assert tensors.where("model.layers.1.self_attn.k_proj.weight") == \
        f"{tiny.path.name}: blk.1.attn_k.weight (F32)"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (H, HKV)
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in tensors


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
@torch.no_grad()
def test_import_matches_transformers(tiny_files, kind):
    """Same file through tfport and through transformers' GGUF loading: logits to float32
    rounding, identical greedy tokens (both dequantise with gguf-py; this checks the config,
    names, tying and un-permutation)."""
    from transformers import AutoModelForCausalLM

    from tfport.models.generate import generate

    tiny = tiny_files(kind)
    ours = load_gguf(tiny.path, tokenizer=False).model
    theirs = AutoModelForCausalLM.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name,
                                                  dtype=torch.float32).eval()
    assert ours.config.tie_embeddings == (kind in ("Q4_1", "Q6_K"))
    ids = torch.tensor([[1, 300, 17, 45, 270, 281, 9, 262]])
    torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, atol=1e-4, rtol=1e-4)
    expected = theirs.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:]
    assert generate(ours, ids, max_new_tokens=8)[0].tolist() == expected.tolist()


# ------------------------------------------------------------------------------------ refusals
def test_a_file_is_parsed_once_until_it_changes(tmp_path):
    """``open_gguf`` shares the parsed header among an export's readers, and parses a file
    written again at the same path afresh."""
    from tfport.models.gguf.reader import open_gguf

    path = tmp_path / "model.gguf"
    first = write_tiny_llama(path, encoder(0), "F32")
    opened = open_gguf(first.path)
    assert open_gguf(str(path)) is opened and read_gguf(path)[0] is opened
    write_tiny_llama(tmp_path / "other.gguf", encoder(1), "Q8_0").path.replace(path)  # same path, new file
    again = open_gguf(path)
    assert again is not opened and again.tensor_type("token_embd.weight") == "Q8_0"


def test_refuses_unknown_and_not_yet_supported_architectures(tmp_path):
    for arch, message in (("fancynet", "unknown GGUF architecture 'fancynet'"),
                          ("nemotron", "GGUF architecture 'nemotron' is not supported yet")):
        tiny = write_tiny_llama(tmp_path / f"{arch}.gguf", encoder(0), "F32", architecture=arch)
        with pytest.raises(ValueError, match=message):
            read_gguf(tiny.path)


def test_refuses_a_bidirectional_file(tmp_path):
    """llama.cpp marks bidirectional embedding models attention.causal = false: not a causal decoder."""
    tiny = write_tiny_llama(tmp_path / "bidi.gguf", encoder(0), "F32", extra_metadata={"llama.attention.causal": False})
    with pytest.raises(ValueError, match=r"llama\.attention\.causal=False is not supported"):
        read_gguf(tiny.path)
    causal = write_tiny_llama(tmp_path / "causal.gguf", encoder(0), "F32", extra_metadata={"llama.attention.causal": True})
    read_gguf(causal.path)


def test_refuses_unsupported_tensor_type(tmp_path):
    odd = np.zeros((4, 18 * 256 // 32), dtype=np.uint8)  # IQ4_NL: 32 values in 18 bytes
    tiny = write_tiny_llama(tmp_path / "odd.gguf", encoder(0), "F32",
                            extra_tensors={"blk.0.extra.weight": ("IQ4_NL", odd)})
    with pytest.raises(ValueError, match=r"\['IQ4_NL'\] are not supported.*blk\.0\.extra\.weight"):
        read_gguf(tiny.path)


def test_refuses_unmapped_tensor(tmp_path):
    norm = np.ones(64, dtype=np.float32)  # a Qwen3-style q norm, which LLaMA has not
    tiny = write_tiny_llama(tmp_path / "qnorm.gguf", encoder(0), "F32",
                            extra_tensors={"blk.0.attn_q_norm.weight": ("F32", norm)})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q_norm\.weight \[64\].*no counterpart"):
        read_gguf(tiny.path)
