"""The draft-model proposer on tiny random models: exact against transformers (float32
greedy) with a draft that is the target itself (every draft right), a one-layer truncation
of it (often wrong) and an unrelated checkpoint; batched, chunked and preempted; its own
KV cache rolled back and freed."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.draft_model import write_layer_draft
from pdserve.testing.reference import generate_like_references, hf_greedy, random_prompts
from pdserve.testing.tiny_models import build_tiny_checkpoint

MAX_NEW = 40
LENGTHS = [1, 4, 16, 17, 60, 130]


def _config(model, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def refs(tiny_llama_path):
    return hf_greedy(tiny_llama_path, random_prompts(23, LENGTHS), MAX_NEW)


@pytest.fixture(scope="module")
def drafts(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "self": tiny_llama_path,
        "one-layer": write_layer_draft(tiny_llama_path, root / "one-layer", 1),
        "other": build_tiny_checkpoint("llama", root / "other", seed=5),
    }


def _run(llm: LLM, refs) -> None:
    generate_like_references(llm, refs)
    stats = llm.stats()
    proposer = llm.engine.spec.proposer
    assert proposer.shadows == {}  # every finished request's shadow is gone
    proposer.kv.pool.check_integrity()
    assert proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks
    assert stats.spec_num_drafts > 0


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=512),
        dict(num_kv_blocks=512, max_num_batched_tokens=16, max_num_seqs=4),
        dict(num_kv_blocks=20, max_num_batched_tokens=64, max_model_len=256),  # preempts
    ],
    ids=["batched", "chunked16", "preempt"],
)
def test_a_draft_that_is_the_target_is_always_accepted(
    tiny_llama_path, refs, drafts, engine_args, enforce_eager
):
    llm = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        enforce_eager=enforce_eager,
        speculative_config=_config(drafts["self"]),
        **engine_args,
    )
    _run(llm, refs)
    stats = llm.stats()
    # The same weights draft what the target draws (a near-tie may part them).
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens
    assert len(stats.spec_accepted_per_pos) == 3
    if engine_args["num_kv_blocks"] == 20:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("draft", ["one-layer", "other"])
def test_a_weaker_draft_changes_nothing_but_its_acceptance(tiny_llama_path, refs, drafts, draft):
    llm = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        num_kv_blocks=512,
        block_size=4,
        max_model_len=256,
        speculative_config=_config(drafts[draft], k=4),
    )
    _run(llm, refs)
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    print(f"{draft}: acceptance {stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens:.2f}")


def test_seeded_sampling_is_unchanged_by_a_draft_model(tiny_llama_path, refs, drafts):
    prompts = [r.prompt for r in refs]
    params = [
        SamplingParams(max_tokens=30, temperature=0.3, seed=7 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=512)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        num_kv_blocks=512,
        speculative_config=_config(drafts["self"]),
    )
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats().spec_num_accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_path, tmp_path):
    other = tmp_path / "big-vocab"
    shutil.copytree(tiny_llama_path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(model=str(tiny_llama_path), dtype="float32", speculative_config=_config(other))


def test_a_missing_draft_model_is_refused_at_start(tiny_llama_path, tmp_path):
    with pytest.raises(ValueError, match="the draft model .* is not a checkpoint directory"):
        LLM(model=str(tiny_llama_path), speculative_config=_config(tmp_path / "nope"))


def test_write_layer_draft_keeps_the_first_layers(tiny_llama_path, tmp_path):
    draft = write_layer_draft(tiny_llama_path, tmp_path / "d", 1)
    config = json.loads((draft / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert (draft / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="must be in"):
        write_layer_draft(tiny_llama_path, tmp_path / "e", 9)


def test_workers_take_the_flag_and_only_decode_loads_the_draft(tiny_llama_path, tmp_path):
    """`pdserve up` gives every worker the engine flags: a prefill worker never speculates,
    so it loads no draft (here: one that does not exist), and a decode worker refuses it."""
    from pdserve.testing.cluster import Cluster

    config = _config(tmp_path / "no-such-draft")
    c = Cluster(tmp_path / "logs")
    try:
        kv = c.start("kvstore", "pdserve.kvstore", "--capacity-bytes", "16MiB")
        model = ["--model", str(tiny_llama_path), "--speculative-config", config]
        c.start("prefill", "pdserve.prefill", "--kvstore", kv.address, *model)
        decode = c.launcher.start(
            "decode", [sys.executable, "-m", "pdserve.decode", "--port", "0", *model], ()
        )
        assert decode.proc.wait(timeout=120) == 2
        assert "is not a checkpoint directory" in decode.log_text()
    finally:
        c.stop_all()
