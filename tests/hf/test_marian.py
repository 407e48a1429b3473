"""Marian import against transformers' MarianMTModel (tiny, random, perturbed; OPUS-MT's choices:
scaled embeddings, SiLU, decoding from the pad id): teacher-forced logits on a right-padded batch,
decode steps on the cache and greedy generation of the export under the runtime, with the
sinusoidal table computed (as MarianMTModel saves no table) and read from the file."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tfport.models.hf import hf_config_to_tfport, load_hf_model
from tfport.models.hf.marian import marian_positions

from .cases import perturbed_model
from .test_bart import check_export_generates, check_teacher_forced_and_cache, perturb_buffers
from .test_t5 import close

transformers = pytest.importorskip("transformers", reason="compared against transformers")

PAD, EOS = 98, 0  # OPUS-MT: </s> 0, <pad> the last id, which also starts decoding
SIZES = dict(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=40,
             scale_embedding=True, activation_function="swish", pad_token_id=PAD, eos_token_id=EOS,
             decoder_start_token_id=PAD)

ENCODER_IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, EOS], [13, 14, 15, 16, EOS, PAD, PAD, PAD]])
ENCODER_MASK = (torch.arange(8) < torch.tensor([[8], [5]])).long()  # right padding
DECODER_IDS = torch.tensor([[PAD, 20, 21, 22, 23], [PAD, 30, 31, 32, 33]])


def position_tables(hf):
    return [stack.embed_positions for stack in (hf.model.encoder, hf.model.decoder)]


def build(table_in_file: bool, directory):
    """A perturbed MarianMTModel saved to ``directory``. Its sinusoidal tables are restored after
    the perturbation (``save_pretrained`` leaves them out and transformers recomputes them), or,
    with ``table_in_file``, kept perturbed and written into the file."""
    hf = perturbed_model("MarianConfig", "MarianMTModel", 21, **SIZES)
    perturb_buffers(hf)
    if table_in_file:
        hf.save_pretrained(directory)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if k != "lm_head.weight" and not k.endswith("embed_tokens.weight")}  # tied copies
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        with torch.no_grad():
            for table in position_tables(hf):
                table.weight.copy_(table.create_weight())
        hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("marian")
    hf = build(False, directory)
    with safe_open(str(directory / "model.safetensors"), "pt") as saved:
        assert not any("embed_positions" in key for key in saved.keys())  # the table is computed
    return hf, load_hf_model(directory)


@pytest.mark.parametrize("dim", [32, 7])
def test_sinusoidal_table_is_marians(dim):
    """sin in the first half, cos in the second, as MarianSinusoidalPositionalEmbedding builds it."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    expected = MarianSinusoidalPositionalEmbedding(40, dim).create_weight()
    torch.testing.assert_close(marian_positions(40, dim), expected, rtol=0, atol=1e-7)


@torch.no_grad()
def test_marian_matches_transformers(pair):
    hf, model = pair
    c = model.config
    assert (c.norm_position, c.activation, c.embedding_norm, c.embedding_scale, c.lm_head_bias) == (
        "post", "silu", False, 32**0.5, True)
    assert (c.decoder_start_token_id, c.pad_token_id, c.eos_token_id) == (PAD, PAD, EOS)
    check_teacher_forced_and_cache(hf, model, ENCODER_IDS, ENCODER_MASK, DECODER_IDS, "marian")


@torch.no_grad()
def test_marian_export_generates_like_transformers(pair, tmp_path):
    hf, model = pair
    check_export_generates(hf, model, tmp_path / "marian", ENCODER_IDS, ENCODER_MASK)


@torch.no_grad()
def test_table_in_the_file_is_read(tmp_path):
    """A file that holds the tables (MarianModel saves them) is read as transformers reads it:
    perturbed tables show that they are not recomputed."""
    hf = build(True, tmp_path)
    model = load_hf_model(tmp_path)
    for table, stack in zip(position_tables(hf), (model.encoder, model.decoder)):
        assert torch.equal(stack.embed.positions.weight, table.weight)
    expected = hf(input_ids=ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=DECODER_IDS).logits
    close(model(ENCODER_IDS, DECODER_IDS, attention_mask=ENCODER_MASK), expected, "table from the file")


@pytest.mark.parametrize("changes, match", [
    (dict(share_encoder_decoder_embeddings=False), r"share_encoder_decoder_embeddings=False.*one token table"),
    (dict(decoder_vocab_size=120), r"decoder_vocab_size=120.*vocab_size=99"),
    (dict(decoder_attention_heads=8), r"decoder_attention_heads=8"),
])
def test_refuses_separate_vocabularies_and_widths(changes, match):
    config = {**transformers.MarianConfig(**SIZES).to_dict(), "architectures": ["MarianMTModel"], **changes}
    with pytest.raises(ValueError, match=match):
        hf_config_to_tfport(config)
