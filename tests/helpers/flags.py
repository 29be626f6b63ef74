"""The engine flags every worker in the tests runs with: one set, and where a test needs
other values, the same set with those values changed in plain sight (``engine_flags``)."""

from __future__ import annotations

# The tiny models in float32 (their exactness against transformers holds to the token), and
# a KV cache of 256 blocks of 16 tokens: room for every test's prompts, little memory.
_SHARED: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 256}


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
