"""The routed expert MLP of Mixtral and Qwen3-MoE.

A router (a linear to one logit per expert, softmax in float32, top-k, renormalised where
the model says) picks ``k`` experts per token; only those run. ``pdserve::moe_experts``
computes them grouped by expert: one stable sort of the (token, choice) pairs by expert,
one gather of the tokens' rows, then for each expert that was chosen at all one gated MLP
over its contiguous rows and an add of them into their tokens' rows. The naive way, the dense loop over every expert
for every token, does ``num_experts / k`` times the work (``bench/engine/moe_step.py``).

The op is opaque to ``torch.compile`` (the rows per expert are data, so the code inside
has data-dependent shapes); a compiled step calls it as it calls paged attention. A CUDA
graph cannot capture it (the row counts are read back to the host): MoE models run their
decode steps eagerly on CUDA.

Numerics follow transformers: the weighted expert outputs are added into a zeroed row in
ascending expert order, as its expert loop does, so float32 output is the same.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.model import ModelConfig
from pdserve.engine.tensor_parallel import ONE_RANK, Shard

_lib = torch.library.Library("pdserve", "FRAGMENT")
_lib.define(
    "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
    "int act) -> Tensor"
)

# Activations of the experts' gated MLP, by the op's ``act`` argument.
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}

# What the expert op computed since the process started, for tests and the bench: "calls"
# (one per expert run on its rows), "rows" (token rows through an expert), "steps".
counters: Counter[str] = Counter()


# How the op computes: "grouped" (the default, above), "grouped_mm" (the same rows, each
# projection of every expert in one call of torch's grouped GEMM), "loop" (transformers'
# way: for each expert chosen, a mask over all (token, choice) pairs to find its rows), or
# "dense" (every expert over every token). The benchmark switches it; the results are the
# same, bit for bit but for "dense".
EXPERT_PATHS = ("grouped", "grouped_mm", "loop", "dense")
expert_path = "grouped"


def _act(x: torch.Tensor, act: int) -> torch.Tensor:
    return F.silu(x) if act == 0 else F.gelu(x, approximate="tanh")


def _expert_mlp(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: int) -> torch.Tensor:
    """One expert's gated MLP over its rows (w13: [2 * inter, hidden], gate then up)."""
    inter = w2.shape[1]
    gate_up = F.linear(rows, w13)
    return F.linear(_act(gate_up[:, :inter], act) * gate_up[:, inter:], w2)


def _by_expert(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (choice, token) pairs grouped by expert: each pair's token and weight, and the
    pairs per expert ([E]).

    The pairs are taken choice-major, so a stable sort by expert orders each expert's rows
    by choice, then token, as transformers' expert loop does (in bfloat16 a row's result
    can depend on its place in the GEMM), and a token's experts come in ascending order, the
    order in which it adds them."""
    n = topk_ids.shape[0]
    flat = topk_ids.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    weights = topk_weights.t().reshape(-1).index_select(0, order)
    return order % n, weights, torch.bincount(flat, minlength=num_experts)


def _moe_experts(
    x: torch.Tensor,  # [N, hidden]
    topk_ids: torch.Tensor,  # [N, k] int64
    topk_weights: torch.Tensor,  # [N, k]
    w13: torch.Tensor,  # [E, 2 * inter, hidden]: gate then up
    w2: torch.Tensor,  # [E, hidden, inter]
    act: int,
) -> torch.Tensor:
    n, k = topk_ids.shape
    if expert_path == "dense":
        return moe_experts_dense(x, topk_ids, topk_weights, w13, w2, act)
    if expert_path == "loop":
        return _moe_experts_loop(x, topk_ids, topk_weights, w13, w2, act)
    out = torch.zeros_like(x)
    if n == 0:
        return out
    tokens, weights, counts = _by_expert(topk_ids, topk_weights, w13.shape[0])
    rows = x.index_select(0, tokens)
    grouped = _grouped_mm_mlp(rows, counts, w13, w2, act) if expert_path == "grouped_mm" else None
    counts = counts.tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = slice(start, start + count)
        if grouped is None:
            y = _expert_mlp(rows[part], w13[expert], w2[expert], act)
        else:
            y = grouped[part]
        out_rows = y * weights[part, None]
        # One add per expert, as transformers does: a single index_add_ over all rows
        # would sum a token's rows in float32 before rounding to bfloat16.
        out.index_add_(0, tokens[part], out_rows.to(x.dtype))
        start += count
    counters["calls"] += sum(1 for count in counts if count)
    counters["rows"] += n * k
    counters["steps"] += 1
    return out


_lib.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::moe_experts")
def _(x, topk_ids, topk_weights, w13, w2, act):
    return torch.empty_like(x)


def _grouped_mm_mlp(rows, counts, w13, w2, act) -> torch.Tensor:
    """Every expert's gated MLP over its contiguous rows, each projection of all experts in
    one ``torch._grouped_mm`` (a private torch API; on the CPU it measured no faster:
    bench/engine/moe_step.py)."""
    inter = w2.shape[2]
    ends = torch.cumsum(counts, 0).to(torch.int32)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    hidden = _act(gate_up[:, :inter], act) * gate_up[:, inter:]
    return torch._grouped_mm(hidden, w2.transpose(1, 2), offs=ends)


def _moe_experts_loop(x, topk_ids, topk_weights, w13, w2, act) -> torch.Tensor:
    """transformers' expert loop: a one-hot mask of every (token, choice) pair, searched
    once per expert that was chosen."""
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids, num_classes=w13.shape[0]).permute(2, 1, 0)  # [E, k, N]
    for expert in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
        choice, token = torch.where(mask[expert])
        y = _expert_mlp(x[token], w13[expert], w2[expert], act)
        out.index_add_(0, token, (y * topk_weights[token, choice, None]).to(x.dtype))
    return out


def moe_experts_dense(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: int,
) -> torch.Tensor:
    """Every expert over every token, weighted by the routing (zero where not chosen): what
    a model without routing would compute. The benchmark's baseline, and a test oracle."""
    num_experts = w13.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=topk_weights.dtype, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        y = _expert_mlp(x, w13[expert], w2[expert], act)
        out += (y * dense[:, expert, None]).to(x.dtype)
    return out


class SparseMoE(nn.Module):
    """Router and experts of one layer; the experts' weights stacked, [E, ...]. In a
    tensor-parallel model each rank holds its part of every expert's intermediate size
    (the router whole): its output is a part of the sum, which the decoder layer adds up."""

    def __init__(self, cfg: ModelConfig, shard: Shard = ONE_RANK) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTS:
            raise ValueError(f"experts with activation {cfg.hidden_act!r} are not supported")
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        # Mixtral weighs the experts' outputs with the float32 routing weights; Qwen3-MoE
        # casts them to the model's dtype first.
        self.float_weights = cfg.family == "mixtral"
        self.act = ACTS[cfg.hidden_act]
        inter = shard.split(cfg.moe_intermediate_size, "expert intermediate size")
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, inter))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, hidden] -> the chosen experts [N, k] and their weights [N, k]."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float_weights:
            weights = weights.to(logits.dtype)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return torch.ops.pdserve.moe_experts(x, ids, weights, self.w13, self.w2, self.act)
