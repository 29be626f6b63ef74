"""Rotary tables against transformers' own rotary embedding: the plain rope read from
config.json (no transformers import), and a scaled one through transformers' init."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.model import ModelConfig
from pdserve.engine.model.loader import _plain_rope_theta, rope_tables


def _checkpoint_config(path, rope_parameters, head_dim=16):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=64,
        hidden_size=head_dim * 4,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=rope_parameters,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    return ModelConfig.from_dir(path)


def _hf_cos_sin(path, positions: int):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(AutoConfig.from_pretrained(path))
    x = torch.zeros(1, positions, 1)
    cos, sin = rotary(x, torch.arange(positions)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize(
    ("rope", "plain"),
    [
        ({"rope_type": "default", "rope_theta": 100000.0}, True),
        (
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            False,
        ),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, False),
    ],
    ids=["default", "llama3", "linear"],
)
def test_rope_tables_equal_transformers(tmp_path, rope, plain):
    cfg = _checkpoint_config(tmp_path, rope)
    assert (_plain_rope_theta(tmp_path) is not None) == plain
    table = rope_tables(cfg, 3000, torch.float32)
    cos, sin = _hf_cos_sin(tmp_path, 3000)
    torch.testing.assert_close(table.cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin, sin, rtol=0, atol=1e-6)
