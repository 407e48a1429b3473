"""One configuration for every transformer family tfport handles.

The same frozen dataclass is read by the PyTorch reference modules, the ONNX exporter and the
torch-free runtime, so it imports nothing but the standard library. It round-trips through JSON
(``to_json`` / ``from_json``) and validates itself on construction: a bad combination raises
``ValueError`` naming the field, the value and what was expected.

Shape legend used across the project: B batch, S new tokens, P past length, T = P + S,
H query heads, Hkv key/value heads, D head dim, E model dim (d_model), V vocab.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from .config_checks import (CLASSIFIER_ACTIVATIONS, CLASSIFIER_DECODER_STARTS,  # noqa: F401 (re-exported)
                            CLASSIFIER_POOLINGS, DISENTANGLED_TERMS, is_int, reject,
                            validate_disentangled, validate_heads_and_training)

FAMILIES = ("encoder", "decoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative", "disentangled", "none")
ENCODER_ONLY_POSITIONS = ("disentangled",)  # no causal or cached form
ROPE_SCALINGS = (None, "linear", "ntk", "llama3", "longrope", "yarn", "dynamic")
ALIBI_SLOPES = ("press", "mpt")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of an encoder, decoder or encoder-decoder transformer.

    ``position="relative"`` is T5's bucketed relative attention bias (``relative_buckets``,
    ``relative_max_distance``), one table per stack shared by its layers. ``lm_head_scale``
    multiplies the final states before the LM head (T5 with tied embeddings: d_model ** -0.5).

    ``position="disentangled"`` is DeBERTa's disentangled attention (He et al., 2021), encoders
    only: one table of 2R relative embeddings per stack, normalised by the stack's norm, which
    each layer projects with its own query and key projections (Qr, Kr [2R, H*D]). Query i and
    key j add c2p = q_i . Kr[r(i, j)] and p2c = k_j . Qr[r(i, j)] (``disentangled_terms``, null:
    both; ``relative_terms`` says which are in effect) to q_i . k_j, all three scaled by
    ``softmax_scale``, which defaults to (D (1 + number of terms)) ** -0.5 here. r(i, j) maps
    i - j to a row: with ``disentangled_buckets`` R, distances up to R / 2 keep their own row and
    larger ones share log-spaced rows up to ``disentangled_max_distance``; with null buckets,
    i - j is clipped to +-R, R = ``disentangled_max_distance``. i and j are slot indices, as
    transformers numbers them (the same relative positions as tfport's mask-counted ones under
    left or right padding).

    Attention variants follow from ``n_kv_heads``: equal to ``n_heads`` is multi-head (MHA), 1 is
    multi-query (MQA), anything between that divides ``n_heads`` is grouped-query (GQA).
    The feed-forward is ``act(x W1) W2``, or ``(act(x Wg) * x W1) W2`` when ``gated_ffn``
    (SwiGLU is ``activation="silu", gated_ffn=True``).

    RoPE scaling (``rope_scaling``): ``linear`` divides the frequencies by the factor, ``ntk``
    raises the base, ``llama3`` divides the low frequencies (wavelength above
    ``rope_original_max_positions / rope_low_freq_factor``) by the factor, keeps the high ones
    (wavelength below ``... / rope_high_freq_factor``) and interpolates smoothly between.
    ``longrope`` (Phi-3) divides frequency i by ``rope_short_factor[i]``, or by
    ``rope_long_factor[i]`` in a call whose longest row runs past ``rope_original_max_positions``
    (max(position_ids) + 1 > it, as transformers decides per forward; keys already cached keep the
    rotation they got). ``yarn`` (Peng et al., 2023) blends f / factor and f over the channels
    between the correction dims of ``rope_beta_fast`` and ``rope_beta_slow`` rotations in
    ``rope_original_max_positions`` (rounded outwards when ``rope_truncate``), linearly.
    ``rope_attention_factor`` multiplies cos and sin (longrope, yarn). ``dynamic`` NTK is plain
    RoPE while a call's longest row (max(position_ids) + 1 = n) stays within
    ``rope_original_max_positions`` L; past it the call uses base
    theta * (factor * n / L - (factor - 1)) ^ (R / (R - 2)), recomputed per call (transformers'
    module keeps the largest n seen until a call shorter than L; in one generation, whose calls
    only grow, the two agree).
    ``rope_local_theta`` gives the sliding-window layers their own base, unscaled (Gemma 3).

    ``rotary_dim`` rotates only the first that many channels of each head (GPT-NeoX's
    ``rotary_pct``, ``partial_rotary_factor``); the rest pass unrotated.
    ``rope_interleaved`` pairs channel 2i with 2i + 1 (GPT-J's rotate-every-two) instead of i with
    i + R/2. ``lm_head_bias`` adds a bias [V] to the logits (GPT-J; BART's ``final_logits_bias``).
    ``parallel_residual`` computes attention and FFN from the same input:
    ``x + attn(attn_norm(x)) + ffn(ffn_norm(x))`` (GPT-NeoX, GPT-J, Falcon).

    ``alibi_slopes`` orders ALiBi's head slopes when H is not a power of two: ``press`` (Press et
    al., BLOOM) or ``mpt`` (MPT: the 2^ceil(log2 H) slopes, odd-indexed first, cut to H).

    ``sliding_window`` W restricts the layers listed in ``local_layers`` (all layers when null).
    In a decoder (causal) they see keys at most W - 1 positions before the query (the query
    itself included: W keys), as Mistral, Gemma 2/3 and Phi-3 do. In an encoder (bidirectional)
    they see keys at most W // 2 positions away on either side (2 (W // 2) + 1 keys), so that
    ModernBERT's ``local_attention`` is W. Positions count real tokens, as RoPE's do.
    ``first_attn_norm`` false leaves layer 0 of a pre-norm stack without its attention norm (the
    sublayer reads the embeddings as they are: ModernBERT, whose embeddings end with a norm).

    ``attention_out_bias`` (null = ``attention_bias``) lets the output projection differ from
    q/k/v (Qwen2: biased q/k/v, unbiased output). ``qk_norm`` applies a per-head RMSNorm [D] to
    queries and keys before RoPE (Qwen3, Gemma 3). ``attn_logit_softcap`` c replaces scaled scores
    s by c * tanh(s / c) before the bias is added; ``final_logit_softcap`` does the same to the
    logits (Gemma 2). ``norm_weight_offset`` is added to every norm weight (Gemma's ``1 + w``);
    ``embedding_scale`` multiplies the token embeddings (Gemma: sqrt(d_model), rounded to the
    model dtype); ``post_sublayer_norm`` normalises each sublayer's output before the residual
    add (Gemma 2/3: ``x + norm2(f(norm1(x)))``).
    """

    family: str
    vocab_size: int
    d_model: int
    n_heads: int
    d_ff: int
    n_encoder_layers: int = 0
    n_decoder_layers: int = 0
    n_kv_heads: int | None = None
    head_dim: int | None = None
    norm: str = "layernorm"
    norm_position: str = "pre"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    gated_ffn: bool = False
    position: str = "learned"
    max_positions: int = 512
    rope_theta: float = 10000.0
    rope_scaling: str | None = None
    rope_scaling_factor: float = 1.0
    rope_original_max_positions: int | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_local_theta: float | None = None
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rotary_dim: int | None = None
    rope_interleaved: bool = False
    alibi_slopes: str = "press"
    sliding_window: int | None = None
    local_layers: tuple[int, ...] | None = None
    relative_buckets: int = 32
    relative_max_distance: int = 128
    disentangled_buckets: int | None = 256
    disentangled_max_distance: int = 512
    disentangled_terms: tuple[str, ...] | None = None
    attention_bias: bool = True
    mlp_bias: bool = True
    attention_scale: float | None = None
    attention_out_bias: bool | None = None
    qk_norm: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    post_sublayer_norm: bool = False
    first_attn_norm: bool = True
    parallel_residual: bool = False
    lm_head_bias: bool = False
    tie_embeddings: bool = True
    lm_head_scale: float = 1.0
    embedding_norm: bool = False
    type_vocab_size: int = 0
    pooler: bool = False
    mlm_head: bool = False
    pad_token_id: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None
    # Sequence classification head (encoder, encoder-decoder; tfport.config_checks.validate_heads_and_training says more).
    n_labels: int = 0
    labels: tuple[str, ...] | None = None
    classifier_pooling: str = "cls"
    classifier_activation: str = "tanh"
    classifier_norm: bool = False
    classifier_decoder_start: str = "start_token"
    # Dropout probabilities, applied in train() mode only (eval mode and exports have none).
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    ffn_dropout: float = 0.0

    def __post_init__(self) -> None:
        self._validate()
        validate_heads_and_training(self)

    # ----------------------------------------------------------------------------- derived values
    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (Hkv)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def fill_token_id(self) -> int:
        """The id padding positions (masked) and rows that already stopped carry: ``pad_token_id``,
        or where it is null the eos id, else 0 (transformers pads with eos when pad is unset)."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_id if self.eos_token_id is not None else 0

    @property
    def dim_per_head(self) -> int:
        """Head dimension D."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def attention_kind(self) -> str:
        """``"mha"``, ``"gqa"`` or ``"mqa"``."""
        if self.kv_heads == self.n_heads:
            return "mha"
        return "mqa" if self.kv_heads == 1 else "gqa"

    @property
    def softmax_scale(self) -> float:
        if self.attention_scale is not None:
            return self.attention_scale
        if self.position == "disentangled":  # DeBERTa: the relative terms share the denominator
            return (self.dim_per_head * (1 + len(self.relative_terms))) ** -0.5
        return self.dim_per_head**-0.5

    @property
    def relative_terms(self) -> tuple[str, ...]:
        """DeBERTa's disentangled terms in effect: ``disentangled_terms``, or both when null."""
        return DISENTANGLED_TERMS if self.disentangled_terms is None else self.disentangled_terms

    @property
    def rotary_channels(self) -> int:
        """Channels of each head that RoPE rotates (all unless ``rotary_dim``)."""
        return self.dim_per_head if self.rotary_dim is None else self.rotary_dim

    @property
    def out_bias(self) -> bool:
        """Whether the attention output projection has a bias."""
        return self.attention_bias if self.attention_out_bias is None else self.attention_out_bias

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.local_layers is None or layer in self.local_layers

    @property
    def has_encoder(self) -> bool:
        return self.family in ("encoder", "encoder-decoder")

    @property
    def has_decoder(self) -> bool:
        return self.family in ("decoder", "encoder-decoder")

    @property
    def uses_position_ids(self) -> bool:
        """Whether graphs take ``position_ids`` (ALiBi and relative bias count them from the mask)."""
        return self.position in ("sinusoidal", "learned", "rope")

    @property
    def final_norm(self) -> bool:
        """Pre-norm stacks end with a norm; post-norm blocks already end normalised."""
        return self.norm_position == "pre"

    # ---------------------------------------------------------------------------------- JSON I/O
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise TypeError(f"config: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config: unknown field(s) {unknown}; known fields are {sorted(known)}")
        tuples = {f.name for f in dataclasses.fields(cls) if "tuple" in str(f.type)}
        data = {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in data.items()}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------------------------- validation
    def _validate(self) -> None:
        def fail(field: str, expected: str) -> None:
            reject(self, field, expected)

        def choice(field: str, options: tuple) -> None:
            if getattr(self, field) not in options:
                fail(field, f"one of {list(options)}")

        def is_number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        choice("family", FAMILIES)
        choice("norm", NORMS)
        choice("norm_position", NORM_POSITIONS)
        choice("activation", ACTIVATIONS)
        choice("position", POSITIONS)
        choice("rope_scaling", ROPE_SCALINGS)
        choice("alibi_slopes", ALIBI_SLOPES)
        for field in ("vocab_size", "d_model", "n_heads", "d_ff", "max_positions"):
            if not is_int(getattr(self, field)) or getattr(self, field) <= 0:
                fail(field, "a positive integer")
        for field in ("n_encoder_layers", "n_decoder_layers", "type_vocab_size"):
            if not is_int(getattr(self, field)) or getattr(self, field) < 0:
                fail(field, "a non-negative integer")
        for field in ("gated_ffn", "attention_bias", "mlp_bias", "tie_embeddings", "embedding_norm",
                      "pooler", "mlm_head", "qk_norm", "post_sublayer_norm", "parallel_residual",
                      "rope_interleaved", "lm_head_bias", "rope_truncate", "first_attn_norm"):
            if not isinstance(getattr(self, field), bool):
                fail(field, "true or false")
        for field in ("rope_theta", "norm_eps", "lm_head_scale", "embedding_scale", "rope_low_freq_factor",
                      "rope_attention_factor", "rope_beta_fast", "rope_beta_slow",
                      "rope_high_freq_factor"):
            if not is_number(getattr(self, field)) or getattr(self, field) <= 0:
                fail(field, "a positive finite number")
        for field in ("rope_local_theta", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, field)
            if value is not None and (not is_number(value) or value <= 0):
                fail(field, "a positive finite number or null")
        if not is_number(self.norm_weight_offset):
            fail("norm_weight_offset", "a finite number")
        if self.attention_out_bias is not None and not isinstance(self.attention_out_bias, bool):
            fail("attention_out_bias", "true, false or null (= attention_bias)")
        for field in ("head_dim", "n_kv_heads", "rope_original_max_positions", "sliding_window", "rotary_dim"):
            value = getattr(self, field)
            if value is not None and (not is_int(value) or value <= 0):
                fail(field, "a positive integer or null")
        if self.attention_scale is not None and (not is_number(self.attention_scale) or self.attention_scale <= 0):
            fail("attention_scale", "a positive finite number or null (= 1/sqrt(head_dim))")
        if not is_number(self.rope_scaling_factor) or self.rope_scaling_factor < 1.0:
            fail("rope_scaling_factor", "a finite number >= 1")
        if self.position == "relative":
            if not is_int(self.relative_buckets) or self.relative_buckets < 4:
                fail("relative_buckets", "an integer >= 4")
            # Causal stacks give exact buckets to distances below relative_buckets // 2; the
            # logarithmic buckets need a larger max distance (bidirectional ones use half).
            if not is_int(self.relative_max_distance) or self.relative_max_distance <= self.relative_buckets // 2:
                fail("relative_max_distance", f"an integer > relative_buckets // 2 = {self.relative_buckets // 2}")
        validate_disentangled(self)
        if self.has_encoder and self.n_encoder_layers == 0:
            fail("n_encoder_layers", f"at least 1 for family {self.family!r}")
        if self.has_decoder and self.n_decoder_layers == 0:
            fail("n_decoder_layers", f"at least 1 for family {self.family!r}")
        if self.family == "encoder" and self.n_decoder_layers:
            fail("n_decoder_layers", "0 for family 'encoder'")
        if self.family == "decoder" and self.n_encoder_layers:
            fail("n_encoder_layers", "0 for family 'decoder' (set family='encoder-decoder')")
        if self.head_dim is None and self.d_model % self.n_heads:
            fail("d_model", f"a multiple of n_heads={self.n_heads} (or set head_dim)")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            fail("n_kv_heads", f"a divisor of n_heads={self.n_heads}")
        if self.position == "rope" and self.dim_per_head % 2:
            fail("head_dim" if self.head_dim else "d_model",
                 f"an even head dimension for RoPE, got {self.dim_per_head}")
        if self.rope_scaling == "ntk" and self.dim_per_head <= 2:
            fail("head_dim" if self.head_dim else "d_model",
                 f"a head dimension above 2 for NTK-aware RoPE scaling, got {self.dim_per_head}")
        if self.rope_scaling is None and self.rope_scaling_factor != 1.0:
            fail("rope_scaling_factor", "1.0 unless rope_scaling is set")
        if self.rope_scaling is not None and self.position != "rope":
            fail("rope_scaling", f"null unless position='rope' (position={self.position!r})")
        if self.rope_scaling == "llama3":
            if self.rope_original_max_positions is None:
                fail("rope_original_max_positions", "the trained context length for rope_scaling='llama3'")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                fail("rope_high_freq_factor", f"above rope_low_freq_factor={self.rope_low_freq_factor} "
                     "(the band between them is interpolated)")
        elif (self.rope_low_freq_factor, self.rope_high_freq_factor) != (1.0, 4.0):
            fail("rope_low_freq_factor" if self.rope_low_freq_factor != 1.0 else "rope_high_freq_factor",
                 "the default (1.0 / 4.0) unless rope_scaling='llama3'")
        if self.rope_original_max_positions is not None and self.rope_scaling not in ("llama3", "longrope", "yarn",
                                                                                      "dynamic"):
            fail("rope_original_max_positions", "null unless rope_scaling is 'llama3', 'longrope', 'yarn' or 'dynamic'")
        if self.rope_scaling in ("yarn", "dynamic") and self.rope_original_max_positions is None:
            fail("rope_original_max_positions", f"the trained context length for rope_scaling={self.rope_scaling!r}")
        if self.rope_scaling != "yarn" and (self.rope_beta_fast, self.rope_beta_slow, self.rope_truncate) != (32.0, 1.0, True):
            fail("rope_beta_fast", "the defaults (rope_beta_fast 32, rope_beta_slow 1, rope_truncate true) "
                 "unless rope_scaling='yarn'")
        if self.rope_scaling == "longrope":
            if self.rope_original_max_positions is None:
                fail("rope_original_max_positions", "the trained context length for rope_scaling='longrope'")
            for field in ("rope_short_factor", "rope_long_factor"):
                value = getattr(self, field)
                if not isinstance(value, tuple) or len(value) != self.rotary_channels // 2 \
                        or not all(is_number(v) and v > 0 for v in value):
                    fail(field, f"{self.rotary_channels // 2} positive factors (one per rotary frequency)")
        elif self.rope_short_factor is not None or self.rope_long_factor is not None:
            fail("rope_short_factor" if self.rope_short_factor is not None else "rope_long_factor",
                 "null unless rope_scaling='longrope'")
        if self.rope_attention_factor != 1.0 and self.rope_scaling not in ("longrope", "yarn"):
            fail("rope_attention_factor", "1.0 unless rope_scaling is 'longrope' or 'yarn'")
        if self.rope_local_theta is not None and (self.position != "rope" or self.sliding_window is None):
            fail("rope_local_theta", "null unless position='rope' with a sliding_window (it is the "
                 "sliding-window layers' RoPE base)")
        if self.local_layers is not None:
            layers = self.local_layers
            if not isinstance(layers, tuple) or not all(is_int(i) for i in layers):
                fail("local_layers", "a tuple of layer indices or null (= every layer)")
            n = max(self.n_encoder_layers, self.n_decoder_layers)
            if any(not 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
                fail("local_layers", f"distinct layer indices in [0, {n})")
            if self.sliding_window is None:
                fail("local_layers", "null unless sliding_window is set")
        if self.sliding_window is not None and self.family == "encoder-decoder":
            fail("sliding_window", "null for family 'encoder-decoder' (windows are causal in a decoder, "
                 "two-sided in an encoder)")
        if not self.first_attn_norm and self.norm_position != "pre":
            fail("first_attn_norm", f"true unless norm_position='pre' (norm_position={self.norm_position!r})")
        if self.rotary_dim is not None:
            if self.position != "rope":
                fail("rotary_dim", f"null unless position='rope' (position={self.position!r})")
            if self.rotary_dim % 2 or self.rotary_dim > self.dim_per_head:
                fail("rotary_dim", f"an even number of channels up to the head dimension {self.dim_per_head}")
        if self.rope_interleaved and self.position != "rope":
            fail("rope_interleaved", f"false unless position='rope' (position={self.position!r})")
        if self.lm_head_bias and not self.has_decoder:
            fail("lm_head_bias", f"false unless the family has a decoder (family={self.family!r})")
        if self.parallel_residual and (self.norm_position != "pre" or self.post_sublayer_norm
                                       or self.family != "decoder"):
            fail("parallel_residual", "false unless a pre-norm decoder without post-sublayer norms")
        if self.norm_weight_offset != 0.0 and self.norm != "rmsnorm":
            fail("norm_weight_offset", f"0.0 unless norm='rmsnorm' (norm={self.norm!r})")
        if self.qk_norm and self.norm != "rmsnorm":
            fail("qk_norm", f"false unless norm='rmsnorm' (the q/k norms are per-head RMSNorms; norm={self.norm!r})")
        if self.family != "encoder" and (self.pooler or self.mlm_head):
            fail("pooler" if self.pooler else "mlm_head", "false unless family='encoder'")
        if self.family != "encoder" and self.type_vocab_size:
            fail("type_vocab_size", "0 unless family='encoder'")
        for field in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, field)
            if value is not None and not (is_int(value) and 0 <= value < self.vocab_size):
                fail(field, f"a token id in [0, {self.vocab_size}) or null")
        if self.family == "encoder-decoder" and self.decoder_start_token_id is None:
            fail("decoder_start_token_id", "a token id for family 'encoder-decoder'")
