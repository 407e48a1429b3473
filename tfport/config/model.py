"""``ModelConfig``: the architecture's backbone (sizes, norm, activation, position scheme, token
ids ...) as flat fields, each concept with several settings as a part of its own (``rope``,
``window``, ``relative``, ``disentangled``, ``moe``, ``classifier``, ``dropout``), and the checks
that need more than one part. The parts validate their own fields (``tfport.config.rope`` ...)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .checks import Checks, is_int, is_number, reject
from .classifier import ClassifierConfig
from .dropout import DropoutConfig
from .json_forms import config_from_dict, parts
from .moe import MoeConfig
from .positions import ALIBI_SLOPES, POSITIONS, DisentangledConfig, RelativeConfig
from .rope import RopeConfig
from .window import WindowConfig

FAMILIES = ("encoder", "decoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
QK_NORM_SPANS = ("head", "all_heads")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of an encoder, decoder or encoder-decoder transformer.

    Attention variants follow from ``n_kv_heads``: equal to ``n_heads`` is multi-head (MHA), 1 is
    multi-query (MQA), anything between that divides ``n_heads`` is grouped-query (GQA).
    The feed-forward is ``act(x W1) W2``, or ``(act(x Wg) * x W1) W2`` when ``gated_ffn``
    (SwiGLU is ``activation="silu", gated_ffn=True``).

    ``position`` picks the scheme: ``rope`` reads ``rope`` (RopeConfig), ``relative`` T5's
    bucketed bias (``relative``: RelativeConfig), ``disentangled`` DeBERTa's disentangled
    attention (``disentangled``: DisentangledConfig, encoders only), ``alibi`` ALiBi, whose head
    slopes ``alibi_slopes`` orders when H is not a power of two: ``press`` (Press et al., BLOOM) or
    ``mpt`` (MPT: the 2^ceil(log2 H) slopes, odd-indexed first, cut to H). ``window``
    (WindowConfig) makes some layers attend through a sliding window. ``lm_head_scale``
    multiplies the final states before the LM head (T5 with tied embeddings: d_model ** -0.5);
    ``lm_head_bias`` adds a bias [V] to the logits (GPT-J; BART's ``final_logits_bias``).
    ``parallel_residual`` computes attention and FFN from the same input:
    ``x + attn(attn_norm(x)) + ffn(ffn_norm(x))`` (GPT-NeoX, GPT-J, Falcon).
    ``first_attn_norm`` false leaves layer 0 of a pre-norm stack without its attention norm (the
    sublayer reads the embeddings as they are: ModernBERT, whose embeddings end with a norm).
    ``moe`` (MoeConfig) replaces the FFN of some decoder layers by a mixture of experts.

    ``attention_out_bias`` (null = ``attention_bias``) lets the output projection differ from
    q/k/v (Qwen2: biased q/k/v, unbiased output). ``qk_norm`` applies a per-head RMSNorm [D] to
    queries and keys before RoPE (Qwen3, Gemma 3), or with ``qk_norm_span="all_heads"`` one
    RMSNorm over all heads' channels (queries [H*D], keys [Hkv*D]: OLMo 2, OLMoE). ``qkv_clip`` c
    clamps queries, keys and values to [-c, c] after those norms, before RoPE (OLMoE's
    ``clip_qkv``). ``attn_logit_softcap`` c replaces scaled scores
    s by c * tanh(s / c) before the bias is added; ``final_logit_softcap`` does the same to the
    logits (Gemma 2). ``norm_weight_offset`` is added to every norm weight (Gemma's ``1 + w``);
    ``embedding_scale`` multiplies the token embeddings (Gemma: sqrt(d_model), rounded to the
    model dtype); ``post_sublayer_norm`` normalises each sublayer's output before the residual
    add (Gemma 2/3: ``x + norm2(f(norm1(x)))``); ``residual_scale`` r multiplies each sublayer's
    output before the residual add of a pre-norm block (Granite: ``x + r * f(norm(x))``).
    ``classifier`` (ClassifierConfig) adds a
    sequence classification head to an encoder or encoder-decoder; ``dropout`` (DropoutConfig)
    holds the training-time dropout probabilities.
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
    rope: RopeConfig = field(default_factory=RopeConfig)
    alibi_slopes: str = "press"
    window: WindowConfig = field(default_factory=WindowConfig)
    relative: RelativeConfig = field(default_factory=RelativeConfig)
    disentangled: DisentangledConfig = field(default_factory=DisentangledConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    attention_bias: bool = True
    mlp_bias: bool = True
    attention_scale: float | None = None
    attention_out_bias: bool | None = None
    qk_norm: bool = False
    qk_norm_span: str = "head"
    qkv_clip: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
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
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    dropout: DropoutConfig = field(default_factory=DropoutConfig)

    def __post_init__(self) -> None:
        self._validate_backbone()
        self._validate_positions()
        self._validate_heads()

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
            return (self.dim_per_head * (1 + len(self.disentangled.effective_terms))) ** -0.5
        return self.dim_per_head**-0.5

    @property
    def rotary_channels(self) -> int:
        """Channels of each head that RoPE rotates (all unless ``rope.rotary_dim``)."""
        return self.dim_per_head if self.rope.rotary_dim is None else self.rope.rotary_dim

    @property
    def out_bias(self) -> bool:
        """Whether the attention output projection has a bias."""
        return self.attention_bias if self.attention_out_bias is None else self.attention_out_bias

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        return self.window.covers(layer)

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
        """The nested form: backbone fields flat, each part an object (``"rope": {...}``)."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """From the nested form, or the flat one earlier versions wrote (``"rope_theta": ...``)."""
        return config_from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again); a part is replaced whole
        (``config.replace(rope=config.rope.replace(theta=5e5))``)."""
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------------------------- validation
    def _validate_backbone(self) -> None:
        """Sizes, layers, norms, flags and token ids."""
        check = Checks(self)
        check.choice("family", FAMILIES)
        check.choice("norm", NORMS)
        check.choice("norm_position", NORM_POSITIONS)
        check.choice("activation", ACTIVATIONS)
        check.choice("position", POSITIONS)
        check.choice("alibi_slopes", ALIBI_SLOPES)
        check.choice("qk_norm_span", QK_NORM_SPANS)
        for name, part in parts(type(self)).items():
            if not isinstance(getattr(self, name), part):
                check.fail(name, f"a {part.__name__}")
        check.positive_ints("vocab_size", "d_model", "n_heads", "d_ff", "max_positions")
        check.non_negative_ints("n_encoder_layers", "n_decoder_layers", "type_vocab_size")
        check.booleans("gated_ffn", "attention_bias", "mlp_bias", "tie_embeddings", "embedding_norm",
                       "pooler", "mlm_head", "qk_norm", "post_sublayer_norm", "parallel_residual",
                       "lm_head_bias", "first_attn_norm")
        check.positive_numbers("norm_eps", "lm_head_scale", "embedding_scale", "residual_scale")
        if self.residual_scale != 1.0 and (self.norm_position != "pre" or self.parallel_residual):
            check.fail("residual_scale", "1.0 unless a pre-norm block without parallel_residual (Granite's "
                       "residual_multiplier)")
        check.positive_numbers("attn_logit_softcap", "final_logit_softcap", "qkv_clip", optional=True)
        if not is_number(self.norm_weight_offset):
            check.fail("norm_weight_offset", "a finite number")
        if self.attention_out_bias is not None and not isinstance(self.attention_out_bias, bool):
            check.fail("attention_out_bias", "true, false or null (= attention_bias)")
        check.positive_ints("head_dim", "n_kv_heads", optional=True)
        if self.attention_scale is not None and (not is_number(self.attention_scale) or self.attention_scale <= 0):
            check.fail("attention_scale", "a positive finite number or null (= 1/sqrt(head_dim))")
        if self.has_encoder and self.n_encoder_layers == 0:
            check.fail("n_encoder_layers", f"at least 1 for family {self.family!r}")
        if self.has_decoder and self.n_decoder_layers == 0:
            check.fail("n_decoder_layers", f"at least 1 for family {self.family!r}")
        if self.family == "encoder" and self.n_decoder_layers:
            check.fail("n_decoder_layers", "0 for family 'encoder'")
        if self.family == "decoder" and self.n_encoder_layers:
            check.fail("n_encoder_layers", "0 for family 'decoder' (set family='encoder-decoder')")
        if self.head_dim is None and self.d_model % self.n_heads:
            check.fail("d_model", f"a multiple of n_heads={self.n_heads} (or set head_dim)")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            check.fail("n_kv_heads", f"a divisor of n_heads={self.n_heads}")
        if not self.first_attn_norm and self.norm_position != "pre":
            check.fail("first_attn_norm", f"true unless norm_position='pre' (norm_position={self.norm_position!r})")
        if self.lm_head_bias and not self.has_decoder:
            check.fail("lm_head_bias", f"false unless the family has a decoder (family={self.family!r})")
        if self.parallel_residual and (self.norm_position != "pre" or self.post_sublayer_norm
                                       or self.family != "decoder"):
            check.fail("parallel_residual", "false unless a pre-norm decoder without post-sublayer norms")
        if self.norm_weight_offset != 0.0 and self.norm != "rmsnorm":
            check.fail("norm_weight_offset", f"0.0 unless norm='rmsnorm' (norm={self.norm!r})")
        if self.qk_norm and self.norm != "rmsnorm":
            check.fail("qk_norm", f"false unless norm='rmsnorm' (the q/k norms are per-head RMSNorms; "
                       f"norm={self.norm!r})")
        if self.qk_norm_span != "head" and not self.qk_norm:
            check.fail("qk_norm_span", "'head' unless qk_norm is true (it says what the q/k norms span)")
        moe = self.moe
        if moe.n_experts and self.family != "decoder":
            reject("moe.n_experts", moe.n_experts, f"0 unless family='decoder' (family={self.family!r})")
        if moe.layers is not None and any(not 0 <= i < self.n_decoder_layers for i in moe.layers):
            reject("moe.layers", moe.layers, f"distinct layer indices in [0, {self.n_decoder_layers})")
        if self.family != "encoder" and (self.pooler or self.mlm_head):
            check.fail("pooler" if self.pooler else "mlm_head", "false unless family='encoder'")
        if self.family != "encoder" and self.type_vocab_size:
            check.fail("type_vocab_size", "0 unless family='encoder'")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and 0 <= value < self.vocab_size):
                check.fail(name, f"a token id in [0, {self.vocab_size}) or null")
        if self.family == "encoder-decoder" and self.decoder_start_token_id is None:
            check.fail("decoder_start_token_id", "a token id for family 'encoder-decoder'")

    def _validate_positions(self) -> None:
        """The parts the position scheme and the layers read: RoPE, the window, DeBERTa's."""
        rope, window, head = self.rope, self.window, "head_dim" if self.head_dim else "d_model"
        check = Checks(self)
        if self.position == "rope" and self.dim_per_head % 2:
            check.fail(head, f"an even head dimension for RoPE, got {self.dim_per_head}")
        if rope.scaling == "ntk" and self.dim_per_head <= 2:
            check.fail(head, f"a head dimension above 2 for NTK-aware RoPE scaling, got {self.dim_per_head}")
        if self.position != "rope":
            for name, default in (("scaling", "null"), ("rotary_dim", "null"), ("interleaved", "false")):
                Checks(rope, "rope.").defaults((name,), f"{default} unless position='rope' "
                                                        f"(position={self.position!r})")
        if rope.rotary_dim is not None and (rope.rotary_dim % 2 or rope.rotary_dim > self.dim_per_head):
            reject("rope.rotary_dim", rope.rotary_dim, f"an even number of channels up to the head "
                   f"dimension {self.dim_per_head}")
        if rope.scaling == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(rope, name)) != self.rotary_channels // 2:
                    reject(f"rope.{name}", getattr(rope, name), f"{self.rotary_channels // 2} positive "
                           "factors (one per rotary frequency)")
        if rope.local_theta is not None and (self.position != "rope" or window.size is None):
            reject("rope.local_theta", rope.local_theta, "null unless position='rope' with a window.size "
                   "(it is the sliding-window layers' RoPE base)")
        n = max(self.n_encoder_layers, self.n_decoder_layers)
        if window.layers is not None and any(not 0 <= i < n for i in window.layers):
            reject("window.layers", window.layers, f"distinct layer indices in [0, {n})")
        if window.size is not None and self.family == "encoder-decoder":
            reject("window.size", window.size, "null for family 'encoder-decoder' (windows are causal in "
                   "a decoder, two-sided in an encoder)")
        if self.position != "disentangled":
            Checks(self.disentangled, "disentangled.").defaults(
                ("buckets", "max_distance", "terms"),
                f"the default unless position='disentangled' (position={self.position!r})")
            return
        if self.family != "encoder":  # ENCODER_ONLY_POSITIONS
            check.fail("position", f"another position for family {self.family!r}: 'disentangled' (DeBERTa) "
                       "is bidirectional and uncached, for family 'encoder'")
        if self.kv_heads != self.n_heads:
            check.fail("n_kv_heads", f"null or n_heads={self.n_heads} with position='disentangled' (each "
                       "query head reads its own relative keys)")

    def _validate_heads(self) -> None:
        """The classification head against the family and token ids."""
        classifier = self.classifier
        if classifier.n_labels and self.family == "decoder":
            reject("classifier.n_labels", classifier.n_labels, "0 unless family is 'encoder' or "
                   "'encoder-decoder' (family='decoder')")
        if classifier.pooling == "last_eos" and self.family != "encoder-decoder":
            reject("classifier.pooling", classifier.pooling, f"'cls' or 'mean' for family {self.family!r} "
                   "('last_eos' reads the decoder of an encoder-decoder)")
        if classifier.n_labels and self.family == "encoder-decoder":
            if classifier.pooling != "last_eos":
                reject("classifier.pooling", classifier.pooling, "'last_eos' for family 'encoder-decoder' "
                       "(the decoder's state at each row's last eos token, as BART's sequence classification)")
            if self.eos_token_id is None:
                Checks(self).fail("eos_token_id", "a token id with classifier.pooling='last_eos' (the head "
                                  "reads the decoder at each row's last one)")
        if classifier.decoder_start != "start_token" and not (self.family == "encoder-decoder"
                                                               and classifier.n_labels):
            reject("classifier.decoder_start", classifier.decoder_start, "'start_token' unless an "
                   "encoder-decoder has a classification head (classifier.n_labels > 0)")
