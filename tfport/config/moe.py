"""Mixture-of-experts feed-forward layers: how many experts, how tokens are routed to them, which
layers have them. ``ModelConfig.moe`` holds one; ``ModelConfig`` checks the layer indices against
its depth."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import Part, is_int

# How the router's logits [N] become the weights of the top-k experts:
# "softmax_topk": softmax over all N experts, keep the k largest (Mixtral, Qwen2/3-MoE, OLMoE), and
#                 divide them by their sum when ``normalize`` (Mixtral always does; Qwen's
#                 ``norm_topk_prob``, also OLMoE's);
# "topk_softmax": keep the k largest logits, softmax over those k (Granite-MoE, gpt-oss).
ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class MoeConfig(Part):
    """``n_experts`` gated or plain FFNs of width ``d_expert`` per MoE layer (0 experts: no MoE),
    of which each token uses ``top_k``, weighted by the router (``routing``, ``normalize``; a
    router bias when ``router_bias``). ``shared_d_ff`` > 0 adds a shared expert every token goes
    through (Qwen2-MoE), scaled by sigmoid(x w) [1] when ``shared_gate``. ``layers`` lists the
    decoder layers whose FFN is the MoE block (null: every layer); the others keep the dense FFN
    of width ``d_ff`` (Qwen2-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).
    """

    PATH = "moe"

    n_experts: int = 0
    top_k: int = 0
    d_expert: int = 0
    routing: str = "softmax_topk"
    normalize: bool = True
    router_bias: bool = False
    shared_d_ff: int = 0
    shared_gate: bool = False
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check = self.checks()
        check.non_negative_ints("n_experts", "top_k", "d_expert", "shared_d_ff")
        check.choice("routing", ROUTINGS)
        check.booleans("normalize", "router_bias", "shared_gate")
        if self.layers is not None:
            if not isinstance(self.layers, tuple) or not all(is_int(i) for i in self.layers):
                check.fail("layers", "a tuple of layer indices or null (= every layer)")
            if len(set(self.layers)) != len(self.layers):
                check.fail("layers", "distinct layer indices")
        if not self.n_experts:
            check.defaults(("top_k", "d_expert", "routing", "normalize", "router_bias", "shared_d_ff",
                            "shared_gate", "layers"), "the default unless moe.n_experts > 0")
            return
        if not 1 <= self.top_k <= self.n_experts:
            check.fail("top_k", f"experts per token in [1, n_experts={self.n_experts}]")
        if self.d_expert < 1:
            check.fail("d_expert", "a positive integer (each expert's FFN width) when moe.n_experts > 0")
        if self.shared_gate and not self.shared_d_ff:
            check.fail("shared_gate", "false unless moe.shared_d_ff > 0 (it gates the shared expert)")

    def covers(self, layer: int) -> bool:
        """Whether layer ``layer``'s FFN is the mixture of experts."""
        return self.n_experts > 0 and (self.layers is None or layer in self.layers)
