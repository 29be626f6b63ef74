"""The model families' configs and shapes against transformers: real-shaped configs of Qwen3-8B,
Gemma-3-12B, Mixtral-8x7B and Qwen3-30B-A3B (configs only, built on the meta device), and the
routed expert MLP's work and numerics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.core.model import SUPPORTED_ARCHITECTURES, ModelConfig
from pdserve.engine.convert_local import describe
from pdserve.engine.model import moe

CONFIGS = Path(__file__).resolve().parents[1] / "helpers" / "model_configs"
REAL = ["Qwen3-8B", "gemma-3-12b-it", "Mixtral-8x7B-v0.1", "Qwen3-30B-A3B"]


def _copy(name: str, tmp_path: Path) -> Path:
    """The config in a folder of the test's own (loading one stores a fingerprint beside it)."""
    return Path(shutil.copytree(CONFIGS / name, tmp_path / name))


def _transformers_figures(path: Path) -> tuple[int, float, list[str]]:
    """transformers' parameter count, KV bytes per token (from its cache after a 3-token
    forward on the meta device) and window of each layer, for the text model of
    ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    hf = AutoConfig.from_pretrained(path)
    text = getattr(hf, "text_config", None) or hf
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    cache = DynamicCache(config=text)
    with torch.device("meta"), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), cache=cache, use_cache=True)
    kv = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None) or 0
    return params, kv / 3, tuple(window if t == "sliding_attention" else 0 for t in types)


@pytest.mark.parametrize("name", REAL)
def test_real_shaped_configs_match_transformers(name, tmp_path):
    path = _copy(name, tmp_path)
    cfg = ModelConfig.from_dir(path)
    summary = describe(cfg)
    params, kv_per_token, windows = _transformers_figures(path)
    assert summary.parameters == params
    assert summary.kv_bytes_per_token == kv_per_token
    assert cfg.layer_windows == windows
    # What the names promise, so that the check above is not of two equal mistakes.
    billions = {"Qwen3-8B": 8.19, "gemma-3-12b-it": 11.77, "Mixtral": 46.70, "Qwen3-30B": 30.53}
    assert round(params / 1e9, 2) == next(v for k, v in billions.items() if name.startswith(k))


def test_gemma3_slides_five_layers_of_six(tmp_path):
    cfg = ModelConfig.from_dir(_copy("gemma-3-12b-it", tmp_path))
    assert cfg.family == "gemma3" and cfg.num_layers == 48
    assert [i for i, w in enumerate(cfg.layer_windows) if w == 0] == list(range(5, 48, 6))
    assert set(cfg.layer_windows) == {0, 1024}
    assert cfg.embed_scale == 3840**0.5 and cfg.attention_scale == 256**-0.5
    assert cfg.eos_token_ids == {1, 106} and cfg.tie_word_embeddings


def test_moe_configs(tmp_path):
    mixtral = ModelConfig.from_dir(_copy("Mixtral-8x7B-v0.1", tmp_path))
    qwen = ModelConfig.from_dir(_copy("Qwen3-30B-A3B", tmp_path))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        8,
        2,
        True,
    )
    assert mixtral.moe_intermediate_size == 14336 and all(mixtral.moe_layers)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.norm_topk_prob) == (128, 8, True)
    assert qwen.moe_intermediate_size == 768 and qwen.qk_norm and all(qwen.moe_layers)
    assert not any(qwen.layer_windows) and not any(mixtral.layer_windows)


def test_an_unsupported_architecture_is_refused_naming_the_list(tmp_path):
    path = _copy("Qwen3-8B", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dir(path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(error.value)


def _routing(n: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 32, 24
    x = torch.randn(n, hidden, generator=g)
    logits = torch.randn(n, experts, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    return x, ids, weights, w13, w2


def test_the_expert_op_runs_only_the_chosen_experts():
    x, ids, weights, w13, w2 = _routing(n=5, experts=16, k=2, seed=0)
    chosen = ids.unique().numel()
    assert chosen < 16  # 5 tokens choose at most 10 of 16
    before = dict(moe.counters)
    out = torch.ops.pdserve.moe_experts(x, ids, weights, w13, w2, 0)
    assert moe.counters["calls"] - before.get("calls", 0) == chosen
    assert moe.counters["rows"] - before.get("rows", 0) == 5 * 2
    dense = moe.moe_experts_dense(x, ids, weights, w13, w2, 0)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_the_expert_op_adds_in_transformers_order():
    """k = 3 (where float32 addition order shows): bit for bit what transformers' expert
    loop gives, in float32 and bfloat16."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    for dtype in (torch.float32, torch.bfloat16):
        x, ids, weights, w13, w2 = _routing(n=40, experts=6, k=3, seed=1)
        x, weights, w13, w2 = (t.to(dtype) for t in (x, weights, w13, w2))
        config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6)
        config._experts_implementation = "eager"
        hf = Qwen3MoeExperts(config).to(dtype)
        with torch.no_grad():
            hf.gate_up_proj.copy_(w13)
            hf.down_proj.copy_(w2)
            expected = hf(x, ids, weights)
        got = torch.ops.pdserve.moe_experts(x, ids, weights, w13, w2, 0)
        assert torch.equal(got, expected), dtype
        try:
            for path in ("loop", "grouped_mm"):  # the benchmark's others compute the same
                moe.expert_path = path
                again = torch.ops.pdserve.moe_experts(x, ids, weights, w13, w2, 0)
                assert torch.equal(again, got), (path, dtype)
        finally:
            moe.expert_path = "grouped"


def test_workers_of_other_windows_have_other_layouts(tmp_path):
    """The block layout header carries the model fingerprint, which hashes config.json: two
    copies of one checkpoint that differ only in their window refuse each other's blocks."""
    from pdserve.kv.blocks import LAYOUT_VERSION, BlockLayout

    a = _copy("Qwen3-8B", tmp_path / "a")
    b = _copy("Qwen3-8B", tmp_path / "b")
    raw = json.loads((b / "config.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=4096, max_window_layers=30)
    (b / "config.json").write_text(json.dumps(raw))
    layouts = []
    for path in (a, b):
        cfg = ModelConfig.from_dir(path)
        layouts.append(
            BlockLayout(LAYOUT_VERSION, cfg.fingerprint, "bfloat16", 16, 36, 8, cfg.head_dim)
        )
    assert ModelConfig.from_dir(b).layer_windows == (0,) * 30 + (4096,) * 6
    (difference,) = layouts[0].differences(layouts[1], "ours", "theirs")
    assert difference.startswith("model_fingerprint:")
