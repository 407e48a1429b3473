"""Named model configurations: tiny ones for tests and demos, and the shapes the field knows.

Presets are plain ``ModelConfig`` values in one dict (no subclasses). The tiny ones are small
enough to build, export and run in well under a second each on a 2-core CPU.
"""

from __future__ import annotations

from .config import ModelConfig
from .config.positions import RelativeConfig
from .config.rope import RopeConfig

_TINY = dict(vocab_size=96, d_model=32, n_heads=4, d_ff=64, max_positions=64)

_TINY_ENCODER = ModelConfig(
    family="encoder", n_encoder_layers=2, norm="layernorm", norm_position="post",
    activation="gelu", position="learned", embedding_norm=True, type_vocab_size=2,
    pooler=True, mlm_head=True, pad_token_id=0, **_TINY,
)
_TINY_DECODER = ModelConfig(
    family="decoder", n_decoder_layers=2, n_kv_heads=2, norm="rmsnorm", norm_position="pre",
    activation="silu", gated_ffn=True, position="rope", attention_bias=False, mlp_bias=False,
    tie_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, **_TINY,
)
_TINY_SEQ2SEQ = ModelConfig(
    family="encoder-decoder", n_encoder_layers=2, n_decoder_layers=2, norm="rmsnorm",
    norm_position="pre", activation="relu", position="sinusoidal", attention_bias=False,
    mlp_bias=False, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, **_TINY,
)

PRESETS: dict[str, ModelConfig] = {
    # ---- tiny, for tests and the demo
    "tiny-encoder": _TINY_ENCODER,
    "tiny-encoder-rope": _TINY_ENCODER.replace(position="rope", norm_position="pre",
                                               norm="rmsnorm", embedding_norm=False),
    "tiny-decoder": _TINY_DECODER,
    "tiny-decoder-mha": _TINY_DECODER.replace(n_kv_heads=None),
    "tiny-decoder-mqa": _TINY_DECODER.replace(n_kv_heads=1),
    "tiny-decoder-gpt2": _TINY_DECODER.replace(
        n_kv_heads=None, norm="layernorm", activation="gelu_tanh", gated_ffn=False,
        position="learned", attention_bias=True, mlp_bias=True, tie_embeddings=True),
    "tiny-decoder-alibi": _TINY_DECODER.replace(
        norm="layernorm", activation="gelu_tanh", gated_ffn=False, position="alibi",
        n_heads=4, n_kv_heads=None, embedding_norm=True, tie_embeddings=True),
    "tiny-decoder-rope-ntk": _TINY_DECODER.replace(rope=RopeConfig(scaling="ntk", scaling_factor=2.0)),
    "tiny-encoder-decoder": _TINY_SEQ2SEQ,
    "tiny-encoder-decoder-gqa": _TINY_SEQ2SEQ.replace(
        n_kv_heads=2, position="rope", activation="silu", gated_ffn=True),
    # T5 v1.1 style: relative bias, unscaled attention, gated GELU, untied head.
    "tiny-encoder-decoder-t5": _TINY_SEQ2SEQ.replace(
        position="relative", relative=RelativeConfig(buckets=8, max_distance=16), attention_scale=1.0,
        activation="gelu_tanh", gated_ffn=True, tie_embeddings=False),
    # ---- shapes the field knows (random weights unless a checkpoint is loaded)
    "bert-base": ModelConfig(
        family="encoder", vocab_size=30522, d_model=768, n_heads=12, d_ff=3072,
        n_encoder_layers=12, norm="layernorm", norm_position="post", norm_eps=1e-12,
        activation="gelu", position="learned", max_positions=512, embedding_norm=True,
        type_vocab_size=2, pooler=True, mlm_head=True, pad_token_id=0),
    "gpt2-small": ModelConfig(
        family="decoder", vocab_size=50257, d_model=768, n_heads=12, d_ff=3072,
        n_decoder_layers=12, norm="layernorm", norm_position="pre", activation="gelu_tanh",
        position="learned", max_positions=1024, tie_embeddings=True, pad_token_id=50256,
        bos_token_id=50256, eos_token_id=50256),
    "t5-small": ModelConfig(
        family="encoder-decoder", vocab_size=32128, d_model=512, n_heads=8, d_ff=2048,
        n_encoder_layers=6, n_decoder_layers=6, norm="rmsnorm", norm_position="pre",
        norm_eps=1e-6, activation="relu", position="relative", max_positions=512,
        attention_bias=False, mlp_bias=False, attention_scale=1.0, tie_embeddings=True,
        lm_head_scale=512**-0.5,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
    "llama3-8b": ModelConfig(
        family="decoder", vocab_size=128256, d_model=4096, n_heads=32, n_kv_heads=8,
        d_ff=14336, n_decoder_layers=32, norm="rmsnorm", norm_position="pre", norm_eps=1e-5,
        activation="silu", gated_ffn=True, position="rope", rope=RopeConfig(theta=500000.0),
        max_positions=8192, attention_bias=False, mlp_bias=False, tie_embeddings=False,
        pad_token_id=128001, bos_token_id=128000, eos_token_id=128001),
    "bloom-560m": ModelConfig(
        family="decoder", vocab_size=250880, d_model=1024, n_heads=16, d_ff=4096,
        n_decoder_layers=24, norm="layernorm", norm_position="pre", activation="gelu_tanh",
        position="alibi", max_positions=2048, embedding_norm=True, tie_embeddings=True,
        pad_token_id=3, bos_token_id=1, eos_token_id=2),
    # The decode benchmark's model (~55M parameters, LLaMA-style).
    "llama-55m": ModelConfig(
        family="decoder", vocab_size=32000, d_model=512, n_heads=8, n_kv_heads=2, d_ff=1408,
        n_decoder_layers=8, norm="rmsnorm", norm_position="pre", activation="silu",
        gated_ffn=True, position="rope", max_positions=2048, attention_bias=False,
        mlp_bias=False, tie_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; a ``ValueError`` lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset={name!r}: expected one of {sorted(PRESETS)}") from None
