"""Tiny random-weight checkpoints of every served family, built with transformers, for fast
exact tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 512


# The kinds build_tiny_checkpoint makes beyond "llama" and "qwen2", with what each tests.
NEW_FAMILIES = ("qwen3", "gemma3", "mixtral", "qwen3_moe")
# Gemma 3's window in the tiny checkpoint: shorter than most test prompts.
TINY_WINDOW = 24


def build_tiny_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """Write a tiny ``kind`` checkpoint with spread-out logits: "llama", "qwen2" (2 layers),
    or one of NEW_FAMILIES (3 layers, head_dim apart from hidden / heads):

    - "qwen3": q/k norms;
    - "gemma3": sliding, full, sliding layers with a window of TINY_WINDOW, a rope base
      per layer type, GeGLU, (1 + w) sandwich norms, a scaled embedding, soft-capped logits;
    - "mixtral": 4 experts, 2 chosen;
    - "qwen3_moe": 6 experts, 3 chosen and renormalised, the middle layer a dense MLP;
    - "mistral": every layer sliding over a window of TINY_WINDOW (blocks leave it).

    Weights are drawn wider than the usual init so that next-token logits are
    well separated (random init at std 0.02 makes near-ties everywhere); in the new
    families norm weights are random too, so that each norm matters.
    """
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA 4:1
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # untied head
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    if kind == "llama":
        config = LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
    elif kind == "qwen2":
        config = Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}
        )
    elif kind in NEW_FAMILIES or kind == "mistral":
        wide = {**common, "num_hidden_layers": 3, "head_dim": 16}
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if kind == "qwen3":
            config = Qwen3Config(**wide, rope_parameters=rope)
        elif kind == "gemma3":
            config = Gemma3TextConfig(
                **wide,
                sliding_window=TINY_WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                query_pre_attn_scalar=16,
                final_logit_softcapping=30.0,
                pad_token_id=0,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                },
            )
        elif kind == "mixtral":
            config = MixtralConfig(
                **wide, num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope
            )
        elif kind == "qwen3_moe":
            config = Qwen3MoeConfig(
                **wide,
                num_experts=6,
                num_experts_per_tok=3,
                norm_topk_prob=True,
                moe_intermediate_size=32,
                mlp_only_layers=[1],
                rope_parameters=rope,
            )
        else:
            config = MistralConfig(**wide, sliding_window=TINY_WINDOW, rope_parameters=rope)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind not in ("llama", "qwen2"):  # (those two keep the weights tests know them by)
        with torch.no_grad():  # norm weights that differ from their init
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0 if kind == "gemma3" else 1.0, 0.3)
    if kind == "qwen2":
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer with TINY_VOCAB entries (ids 0-2: <pad>, <s>, </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog. " * 4,
        "pdserve serves tokens, fast and exact. " * 4,
        "Überraschung! Ça va? 東京は日本の首都です。🙂 " * 2,
    ]
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def first_layers_checkpoint(source: Path, layers: int, path: Path) -> Path:
    """A copy of the checkpoint at ``source`` keeping its first ``layers`` decoder layers
    (the same shapes, weights, tokenizer; the final norm and head on top): a real model's
    kernels at a fraction of a full model's compile time."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, path / f.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            kept[name] = tensor
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    return path
