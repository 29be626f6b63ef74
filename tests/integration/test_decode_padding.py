"""Bucketed decode on the CPU: the choice of bucket, and a padded step (as a CUDA graph
replays it) giving exactly the unpadded step's rows while writing no other KV slot."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cuda_graphs import bucket_for, decode_buckets


def test_decode_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]


@pytest.mark.parametrize(
    "n, bucket", [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (33, 48), (64, 64), (65, None)]
)
def test_bucket_for(n, bucket):
    assert bucket_for(n, decode_buckets(64)) == bucket


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_padded_decode_step_equals_the_unpadded_one(tiny_llama_path, backend):
    llm = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        device="cpu",  # also on a CUDA machine: this is the CPU's bucketed step
        num_kv_blocks=64,
        attention_backend=backend,
        enforce_eager=True,
    )
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for k, n in enumerate([3, 17, 30]):
        engine.add_request(list(range(10 + k, 10 + k + n)), params)
    for _ in range(3):  # prefill, then two decode steps
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [1, 1, 1]

    def hidden(pad: int) -> torch.Tensor:
        step = runner.inputs.prepare(batch.seqs, batch.num_new_tokens, pad_decode_to=pad)
        n = step.num_tokens
        with torch.inference_mode(), runner._step_context(step.meta):
            out = runner.model(runner.inputs.input_ids[:n], runner.inputs.positions[:n])
        return out[step.logit_rows].clone()

    plain = hidden(0)
    kv_before = runner.kv.clone()
    padded = hidden(8)  # a batch of 3 in the bucket of 8
    assert torch.equal(padded, plain)
    assert torch.equal(runner.kv, kv_before)  # the same writes again, and nothing else
