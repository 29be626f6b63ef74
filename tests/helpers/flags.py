"""The engine flags every worker in the tests runs with: one set, and where a test needs
other values, the same set with those values changed in plain sight (``engine_flags``)."""

from __future__ import annotations

# The tiny models in float32 (their exactness against transformers holds to the token), a
# KV cache of 256 blocks of 16 tokens (room for every test's prompts, little memory), and the
# plain step: compiling it costs each worker process some 8 s of CPU even with a warm
# inductor cache (a tiny Llama on an AVX2 EPYC; 97 s cold for SmolLM2). The compiled step's
# exactness runs in-process in every mode (test_exactness_*, test_spec_decode,
# test_draft_model); through worker processes in test_e2e_grpc (COMPILED) and `pdserve up`.
_SHARED: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 256, "enforce_eager": "on"}


def engine_flags(**change: object) -> list[str]:
    """The shared flags as argv with ``change`` applied: ``num_kv_blocks=512`` replaces a
    value, ``max_num_seqs=32`` adds a flag (``--max-num-seqs 32``), ``num_kv_blocks=None``
    drops one."""
    merged = {**_SHARED, **change}
    return [
        arg
        for name, value in merged.items()
        if value is not None
        for arg in (f"--{name.replace('_', '-')}", str(value))
    ]


ENGINE = engine_flags()
COMPILED = engine_flags(enforce_eager=None)  # the default step: compiled (CUDA graphs on a GPU)
