"""Mixture-of-experts feed-forward (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE): a router picks
``top_k`` of ``n_experts`` FFNs per token and sums their outputs weighted by its routing weights;
Qwen2-MoE adds a shared expert every token goes through, behind a sigmoid gate.

Every expert is evaluated on every token and weighted by the dense routing weights [B, S, N]
(zero for the experts a token does not use): exactly what a sparse dispatch computes (an expert's
weight-0 contribution adds an exact 0), in the same order (expert 0 first, as transformers'
``index_add_`` loop), and what the exported graph computes. It costs N / top_k times the FFN work
of a sparse dispatch, which is the reference's price for simplicity.
"""

from __future__ import annotations

import torch
from torch import nn

from tfport.config import ModelConfig

from .layers import FeedForward


def routing_weights(logits: torch.Tensor, top_k: int, routing: str, normalize: bool) -> torch.Tensor:
    """Router logits [..., N] -> dense float32 routing weights [..., N], zero outside each token's
    top ``top_k`` experts.

    ``"softmax_topk"``: softmax over the N experts, keep the top k (divided by their sum when
    ``normalize``); ``"topk_softmax"``: softmax over the top k logits (see ``tfport.config.moe``).
    """
    logits = logits.float()
    if routing == "softmax_topk":
        top, index = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)  # [..., k]
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
    elif routing == "topk_softmax":
        top, index = torch.topk(logits, top_k, dim=-1)
        top = torch.softmax(top, dim=-1)
    else:
        raise ValueError(f"routing={routing!r}: expected one of 'softmax_topk', 'topk_softmax'")
    return torch.zeros_like(logits).scatter(-1, index, top)


class MixtureOfExperts(nn.Module):
    """x [B, S, E] -> sum_n w[..., n] * expert_n(x) (+ the gated shared expert) [B, S, E].

    ``router`` [E -> N] (bias when ``moe.router_bias``), ``experts`` N FeedForwards of width
    ``moe.d_expert`` (gated and biased as the model's FFN), ``shared`` a FeedForward of width
    ``moe.shared_d_ff`` or None, ``shared_gate`` [E -> 1] or None.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = self.moe = config.moe
        self.router = nn.Linear(config.d_model, moe.n_experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(FeedForward(config, moe.d_expert) for _ in range(moe.n_experts))
        self.shared = FeedForward(config, moe.shared_d_ff) if moe.shared_d_ff else None
        self.shared_gate = nn.Linear(config.d_model, 1, bias=False) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = routing_weights(self.router(x), self.moe.top_k, self.moe.routing,
                                  self.moe.normalize).to(x.dtype)  # [B, S, N]
        out = torch.zeros_like(x)
        for n, expert in enumerate(self.experts):
            out = out + expert(x) * weights[..., n:n + 1]
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out
