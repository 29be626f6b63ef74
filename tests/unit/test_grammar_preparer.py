"""A worker's grammar compiles, off the engine thread and bounded: a grammar past the
deadline is refused as the request's fault, one queued behind it as busy (retry), a bad one
with the compiler's reason; a cached one costs nothing."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.core.sampling import SamplingParams, StructuredOutputs
from pdserve.engine.structured_output import GrammarCompiler, GrammarError
from pdserve.worker.grammars import GrammarBusy, GrammarPreparer


def many_properties(n: int) -> SamplingParams:
    """A schema whose compile takes seconds on the tiny tokenizer (xgrammar's time for
    optional properties grows faster than their count)."""
    props = {f"p{i}": {"type": "string", "maxLength": 60} for i in range(n)}
    return SamplingParams(
        structured_outputs=StructuredOutputs(
            json=json.dumps({"type": "object", "properties": props})
        )
    )


@pytest.fixture
def preparer(tiny_llama_path):
    from pdserve.testing.tiny_models import TINY_VOCAB

    compiler = GrammarCompiler(tiny_llama_path, TINY_VOCAB, [2])
    compiler.warm()
    p = GrammarPreparer(compiler, timeout_s=0.3)
    yield p
    p.close()


async def test_bounded_busy_bad_and_cached(preparer):
    fast = SamplingParams(structured_outputs=StructuredOutputs(choice=["a", "b"]))
    await preparer.prepare(fast)
    assert preparer.compiler.is_cached(fast.structured_outputs)
    began = time.monotonic()
    await preparer.prepare(fast)  # cached
    await preparer.prepare(SamplingParams())  # no grammar
    assert time.monotonic() - began < 0.1

    slow, queued = many_properties(900), many_properties(901)
    first = asyncio.create_task(preparer.prepare(slow))
    await asyncio.sleep(0.05)  # the slow one has the compile thread
    with pytest.raises(GrammarBusy, match="other requests"):
        await preparer.prepare(queued)
    with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
        await first
    # Its compile runs on to the end and is cached: the same grammar is then served at once.
    deadline = time.monotonic() + 60
    while not preparer.compiler.is_cached(slow.structured_outputs):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    await preparer.prepare(slow)
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="[.*"))
    with pytest.raises(GrammarError, match="regex"):
        await preparer.prepare(bad)
