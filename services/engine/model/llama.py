"""The decoder of every served family over a paged KV cache: Llama, Mistral and SmolLM,
Qwen2 and Qwen3, Gemma 3 (text), and the mixtures of experts Mixtral and Qwen3-MoE.

One Llama-shaped layer with what the others add, read from ``ModelConfig``: per-head
RMSNorm of q and k (Qwen3, Gemma 3), a per-layer attention window (Mistral, Gemma 3's
sliding layers), Gemma 3's (1 + w) norms around attention and MLP, GeGLU, scaled embedding,
rotary tables per layer type and soft-capped logits, and a routed expert MLP
(``pdserve.engine.model.moe``).

Numerics follow Hugging Face transformers (RMSNorm in float32, rotary tables in
float32 cast to the model dtype) so that float32 greedy output matches it. Attention is
the ``pdserve::paged_attention`` op: the KV caches and the step's metadata come from the
forward context, so the model itself takes only token ids and positions, and compiles
or captures as one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.model import ModelConfig
from pdserve.engine.model import ops
from pdserve.engine.model.moe import SparseMoE
from pdserve.engine.tensor_parallel import ONE_RANK, Shard, all_reduce, group_of


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight stored as an offset from 1, applied in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def make_norm(cfg: ModelConfig, size: int) -> nn.Module:
    return (GemmaRMSNorm if cfg.gemma_norms else RMSNorm)(size, cfg.rms_norm_eps)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    """The gated MLP's activation by its transformers name."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported; pdserve has {sorted(_ACTIVATIONS)}"
        ) from None


class Rotary(nn.Module):
    """cos/sin tables for every position up to ``max_positions``."""

    def __init__(
        self, inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [N, H, D], k: [N, Hkv, D]; cos/sin: [N, 1, D]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """This rank's heads (all of them at one rank): q, k, v column parallel, o_proj row
    parallel (its output summed over the ranks by the decoder layer)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, shard: Shard = ONE_RANK) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = shard.split(cfg.num_heads, "attention heads")
        self.num_kv_heads = shard.split(cfg.num_kv_heads, "KV heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        # Sliding-window attention: a query at position p sees keys p - window < j <= p
        # (transformers' rule); 0 attends the whole context.
        self.window = cfg.layer_windows[layer_index] if cfg.layer_windows else 0
        # Qwen3 and Gemma 3 normalise each head of q and k before the rotation.
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        # True: the C++ pdserve_cpu::attention (the CPU kernels, step set by ops.cpu_step).
        self.cpp_op = False
        # q, k and v projections fused into one matmul.
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, hidden] -> rotated q [N, H, D], k [N, Hkv, D], and v [N, Hkv, D]."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this layer's K/V into the paged cache, attend: [N, H, D]."""
        if self.cpp_op:
            return torch.ops.pdserve_cpu.attention(
                q, k, v, self.layer_index, self.scale, self.window
            )
        return ops.paged_attention(q, k, v, self.layer_index, self.scale, self.window)


class MLP(nn.Module):
    """This rank's part of the intermediate size: gate/up column parallel, down row
    parallel (summed over the ranks by the decoder layer)."""

    def __init__(self, cfg: ModelConfig, shard: Shard = ONE_RANK) -> None:
        super().__init__()
        inter = shard.split(cfg.intermediate_size, "MLP intermediate size")
        self.intermediate_size = inter
        self.act = activation(cfg.hidden_act)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, shard: Shard = ONE_RANK) -> None:
        super().__init__()
        self.shard = shard
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer_index, shard)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        routed = bool(cfg.moe_layers) and cfg.moe_layers[layer_index]
        self.mlp = SparseMoE(cfg, shard) if routed else MLP(cfg, shard)
        # Gemma 3 normalises the attention's and the MLP's outputs too ("sandwich" norms);
        # its post_attention_layernorm is then the attention output's.
        self.sandwich = cfg.gemma_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        # Whether torch.compile compiles the code around attention once for all layers
        # (nested compile regions); inductor's C++ wrapper cannot call such regions.
        self.shared_regions = True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        if self.shared_regions:
            q, k, v = self._before_attention_region(x, positions, rotary)
            return self._after_attention_region(x, self.self_attn.attend(q, k, v))
        q, k, v = self._before_attention(x, positions, rotary)
        return self._after_attention(x, self.self_attn.attend(q, k, v))

    def _before_attention(self, x, positions, rotary):
        return self.self_attn.project(self.input_layernorm(x), positions, rotary)

    def _after_attention(self, x, attn):
        n = x.shape[0]
        out = all_reduce(self.self_attn.o_proj(attn.reshape(n, self.self_attn.q_size)), self.shard)
        if self.sandwich:
            x = x + self.post_attention_layernorm(out)
            mlp = all_reduce(self.mlp(self.pre_feedforward_layernorm(x)), self.shard)
            return x + self.post_feedforward_layernorm(mlp)
        x = x + out
        return x + all_reduce(self.mlp(self.post_attention_layernorm(x)), self.shard)

    # The same code in every layer (the layer index only reaches the attention op between
    # them): torch.compile traces and compiles each once per model.
    _before_attention_region = torch.compiler.nested_compile_region(_before_attention)
    _after_attention_region = torch.compiler.nested_compile_region(_after_attention)


class LlamaForCausalLM(nn.Module):
    """Token ids and positions of a flat batch in, hidden states out; logits on request.

    ``rotary`` serves the full-attention layers, ``local_rotary`` (Gemma 3) the sliding
    ones; without it every layer takes ``rotary``. ``shard``: this rank's part of a
    tensor-parallel model (``pdserve.engine.tensor_parallel``); the embedding and the LM
    head then hold its rows of the vocabulary."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: Rotary,
        local_rotary: Rotary | None = None,
        shard: Shard = ONE_RANK,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.vocab_start, self.vocab_end = shard.vocab_range(cfg.vocab_size)
        vocab = shard.vocab_part(cfg.vocab_size)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary
        self.local_rotary = local_rotary
        # Gemma 3 scales the embedding by sqrt(hidden) rounded to the model's dtype, as
        # transformers does; set by the loader, which knows the dtype.
        self.embed_scale: float | None = None
        # Whether every layer runs the same code around attention (then compiled once for
        # all, see DecoderLayer.shared_regions): not where some layers route over experts
        # and others do not, nor with a rotary table per layer type.
        moe = set(cfg.moe_layers or (False,))
        self.uniform_layers = len(moe) == 1 and local_rotary is None

    def rotary_of(self, layer: int) -> Rotary:
        """The rotary tables of ``layer``: Gemma 3's sliding layers have their own."""
        if self.local_rotary is not None and self.cfg.layer_windows[layer]:
            return self.local_rotary
        return self.rotary

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
    ) -> torch.Tensor:
        """[N] token ids at [N] positions -> [N, hidden] final hidden states."""
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary_of(i))
        return self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return self.embed_tokens(input_ids)
        # This rank's rows of the vocabulary; the others' tokens give zeros, and the sum
        # over the ranks is each token's row (adding zeros is exact in any dtype).
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_end - self.vocab_start)
        x = self.embed_tokens(torch.where(mine, local, 0))
        x = torch.where(mine.unsqueeze(-1), x, 0)
        return all_reduce(x, self.shard)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] float32 (soft-capped where the model says). In a
        tensor-parallel model every rank calls it (each computes its rows of the
        vocabulary, gathered on all)."""
        logits = self.lm_head(hidden)
        if self.shard.size > 1 and hidden.shape[0] == 0:
            logits = logits.new_empty(0, self.cfg.vocab_size)
        elif self.shard.size > 1:
            parts = group_of(self.shard.group).all_gather(logits.contiguous())
            logits = torch.cat(parts, dim=-1)[:, : self.cfg.vocab_size]
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
