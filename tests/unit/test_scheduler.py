"""Scheduler without a model: a fake runner plays each step; exact plans, blocks and counters."""

from __future__ import annotations

import random

import pytest

from pdserve.core.sampling import SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.outputs import ModelRunnerOutput
from pdserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode import SpecDecoder, accept_drafts
from pdserve.settings.speculative import SpeculativeConfig

BS = 4
EOS = 2


def make_scheduler(
    num_blocks: int,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS, b"fp", prefix_caching)
    return Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len), kv)


def make_seq(request_id: str, prompt: list[int], **params) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(**params), frozenset({EOS}))


class FakeRunner:
    """Plays the model runner: writes each computed token into a shadow KV cache and
    samples a token for every sequence whose step reaches its last known token.

    Before writing, it checks that the sequence's blocks hold exactly its computed
    tokens, so a wrong prefix hit or a block shared while being written shows up.
    """

    def __init__(self, sched: Scheduler, scripts: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.scripts = scripts or {}
        self.kv: dict[int, list[int | None]] = {}

    def token(self, seq: Sequence, offset: int = 0) -> int:
        k = seq.num_output_tokens + offset
        script = self.scripts.get(seq.request_id, [])
        return script[k] if k < len(script) else 1000 + k

    def __call__(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Writes each scheduled token into its slot (drafts too), after checking that every
        slot before holds the sequence's own token: a rejected draft left in the cache and
        read as context fails here."""
        pool = self.sched.kv_cache.pool
        sampled: list[list[int]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            drafts = batch.draft_token_ids.get(seq.request_id, [])
            tokens = seq.token_ids + drafts
            assert 0 < n <= len(tokens) - start
            assert not drafts or start + n == len(tokens)
            for pos in range(start):
                block = seq.block_table[pos // BS]
                assert self.kv[block][pos % BS] == seq.token_ids[pos], (seq.request_id, pos)
            for pos in range(start, start + n):
                block = seq.block_table[pos // BS]
                assert pool.ref_counts[block] == 1, f"write into shared block {block}"
                self.kv.setdefault(block, [None] * BS)[pos % BS] = tokens[pos]
            if drafts:
                draws = [self.token(seq, j) for j in range(len(drafts) + 1)]
                sampled.append(accept_drafts(drafts, draws))
            else:
                sampled.append([self.token(seq)] if start + n == seq.num_tokens else [])
        return ModelRunnerOutput(sampled, [[None] * len(t) for t in sampled])


def step(
    sched: Scheduler, runner: FakeRunner
) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    """One engine step: (plan as (request id, tokens), preempted ids, finished ids)."""
    batch = sched.schedule()
    assert batch.total_tokens <= sched.config.max_num_batched_tokens
    finished = sched.update(batch, runner(batch)) if batch else []
    assert len(sched.running) <= sched.config.max_num_seqs
    sched.kv_cache.pool.check_integrity()
    plan = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    return plan, [s.request_id for s in batch.preempted], [s.request_id for s in finished]


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps: int = 200) -> int:
    for i in range(max_steps):
        if not sched.has_unfinished():
            return i
        step(sched, runner)
    raise AssertionError(f"not finished after {max_steps} steps")


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.ref_counts == [0] * pool.num_blocks
    pool.check_integrity()


# -- order and budget ----------------------------------------------------------------------


def test_running_sequences_go_first_then_waiting_in_arrival_order():
    sched = make_scheduler(16, budget=8)
    runner = FakeRunner(sched)
    sched.add(make_seq("a", range(5), max_tokens=3))
    assert step(sched, runner) == ([("a", 5)], [], [])
    sched.add(make_seq("b", range(10, 20), max_tokens=1))
    sched.add(make_seq("c", range(20, 23), max_tokens=1))
    assert step(sched, runner) == ([("a", 1), ("b", 7)], [], [])
    assert step(sched, runner) == ([("a", 1), ("b", 3), ("c", 3)], [], ["a", "b", "c"])
    assert not sched.has_unfinished()
    assert_all_free(sched)


def test_chunked_prefill_under_the_token_budget():
    sched = make_scheduler(32, budget=32)
    runner = FakeRunner(sched)
    a = make_seq("a", range(50), max_tokens=3)
    b = make_seq("b", range(100, 130), max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert step(sched, runner) == ([("a", 32)], [], [])
    assert a.num_output_tokens == 0
    assert [s.request_id for s in sched.waiting] == ["b"]
    assert step(sched, runner) == ([("a", 18), ("b", 14)], [], [])
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert step(sched, runner) == ([("a", 1), ("b", 16)], [], [])
    assert step(sched, runner) == ([("a", 1), ("b", 1)], [], ["a", "b"])
    assert a.output_token_ids == [1000, 1001, 1002]
    assert b.output_token_ids == [1000, 1001]
    assert (a.finish_reason, b.finish_reason) == ("length", "length")
    kv = sched.kv_cache
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (80, 0)
    assert_all_free(sched)


def test_max_num_seqs_holds_back_waiting_sequences():
    sched = make_scheduler(16, max_num_seqs=2)
    runner = FakeRunner(sched)
    sched.add(make_seq("a", [1, 3, 4], max_tokens=2))
    sched.add(make_seq("b", [5, 6, 7], max_tokens=3))
    sched.add(make_seq("c", [8, 9, 10], max_tokens=1))
    assert step(sched, runner) == ([("a", 3), ("b", 3)], [], [])
    assert step(sched, runner) == ([("a", 1), ("b", 1)], [], ["a"])
    assert [s.request_id for s in sched.waiting] == ["c"]
    assert step(sched, runner) == ([("b", 1), ("c", 3)], [], ["b", "c"])
    assert_all_free(sched)


def test_prefix_hit_skips_cached_blocks_and_counts():
    sched = make_scheduler(16)
    runner = FakeRunner(sched)
    a = make_seq("a", range(10), max_tokens=1)
    sched.add(a)
    assert step(sched, runner) == ([("a", 10)], [], ["a"])
    b = make_seq("b", [*range(8), 50, 51, 52], max_tokens=1)
    sched.add(b)
    assert step(sched, runner) == ([("b", 3)], [], ["b"])
    assert b.num_cached_tokens == 8
    kv = sched.kv_cache
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    assert_all_free(sched)


def test_empty_schedule_when_nothing_is_waiting():
    sched = make_scheduler(4)
    batch = sched.schedule()
    assert not batch
    assert batch.total_tokens == 0
    assert not sched.has_unfinished()


# -- preemption ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching, recompute", [(True, 5), (False, 9)])
def test_preemption_of_the_newest_sequence_then_recompute(prefix_caching, recompute):
    sched = make_scheduler(4, prefix_caching=prefix_caching)
    runner = FakeRunner(sched)
    a = make_seq("a", range(10, 17), max_tokens=4)
    b = make_seq("b", range(20, 27), max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert step(sched, runner) == ([("a", 7), ("b", 7)], [], [])
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert step(sched, runner) == ([("a", 1), ("b", 1)], [], [])

    # a needs a third block; none is free, so b (admitted last) gives its blocks up.
    c = make_seq("c", [30, 31, 32], max_tokens=1)
    sched.add(c)
    assert step(sched, runner) == ([("a", 1)], ["b"], [])
    assert sched.num_preemptions == 1
    assert (b.status, b.num_preemptions, b.num_computed_tokens) == (
        SequenceStatus.PREEMPTED,
        1,
        0,
    )
    assert b.block_table == []
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert [s.request_id for s in sched.running] == ["a"]
    assert a.block_table == [0, 1, 3]  # b's tail block, freed first, is reused first

    # b (9 tokens now) does not fit yet, and c waits behind it.
    assert step(sched, runner) == ([("a", 1)], [], ["a"])
    assert b.num_tokens == 9
    assert [s.request_id for s in sched.waiting] == ["b", "c"]

    # b recomputes prompt + generated tokens (after its surviving cached block, if any).
    assert step(sched, runner) == ([("b", recompute), ("c", 3)], [], ["c"])
    assert b.block_table == [2, 3, 1]
    assert c.block_table == []
    assert step(sched, runner) == ([("b", 1)], [], ["b"])
    assert b.output_token_ids == [1000, 1001, 1002, 1003]
    assert b.finish_reason == "length"
    assert b.num_cached_tokens == 0
    assert sched.num_preemptions == 1
    kv = sched.kv_cache
    hits = 4 if prefix_caching else 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (7 + 7 + 9 + 3, hits)
    assert_all_free(sched)


def test_a_sequence_that_cannot_grow_and_is_newest_preempts_itself():
    sched = make_scheduler(4)
    runner = FakeRunner(sched)
    a = make_seq("a", range(10, 15), max_tokens=3)  # room to grow to 8 tokens in 2 blocks
    b = make_seq("b", range(20, 27), max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert step(sched, runner) == ([("a", 5), ("b", 7)], [], [])
    assert step(sched, runner) == ([("a", 1), ("b", 1)], [], [])
    assert step(sched, runner) == ([("a", 1)], ["b"], ["a"])
    assert a.block_table == []
    assert b.status == SequenceStatus.PREEMPTED
    run_to_end(sched, runner)
    assert b.output_token_ids == [1000, 1001, 1002]
    assert_all_free(sched)


def test_two_growing_sequences_preempt_the_two_newest_in_one_step():
    sched = make_scheduler(4)
    runner = FakeRunner(sched)
    seqs = [
        make_seq("a", range(0, 4), max_tokens=3),
        make_seq("b", range(10, 14), max_tokens=3),
        make_seq("c", range(20, 23), max_tokens=3),
        make_seq("d", range(30, 33), max_tokens=3),
    ]
    for s in seqs:
        sched.add(s)
    assert step(sched, runner) == ([("a", 4), ("b", 4), ("c", 3), ("d", 3)], [], [])
    assert [s.block_table for s in seqs] == [[0], [1], [2], [3]]
    # a and b each open a second block: d's block goes to a, then c's to b.
    assert step(sched, runner) == ([("a", 1), ("b", 1)], ["d", "c"], [])
    assert [s.block_table for s in seqs] == [[0, 3], [1, 2], [], []]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    assert sched.num_preemptions == 2
    run_to_end(sched, runner)
    for s in seqs:
        assert s.output_token_ids == [1000, 1001, 1002]
        assert s.finish_reason == "length"
    assert_all_free(sched)


# -- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, script, max_model_len, output, reason",
    [
        (dict(max_tokens=5), [5, EOS, 9], 128, [5, EOS], "stop"),
        (dict(max_tokens=3, ignore_eos=True), [5, EOS, 9, 9], 128, [5, EOS, 9], "length"),
        (dict(max_tokens=5, stop_token_ids=(9,)), [5, 9, 3], 128, [5, 9], "stop"),
        (dict(max_tokens=2), [5, 6, 7], 128, [5, 6], "length"),
        (dict(max_tokens=16), [5, 6, 7, 8], 10, [5, 6], "length"),
        (dict(max_tokens=5, min_tokens=3), [EOS, EOS, EOS, EOS], 128, [EOS] * 3, "stop"),
        (dict(max_tokens=5, min_tokens=2, stop_token_ids=(9,)), [9, 9, 9], 128, [9, 9], "stop"),
        (dict(max_tokens=3, min_tokens=3), [EOS, 5, 6, EOS], 128, [EOS, 5, 6], "length"),
    ],
    ids=[
        "eos",
        "ignore_eos",
        "stop_token_ids",
        "max_tokens",
        "max_model_len",
        "min_tokens_delays_eos",
        "min_tokens_delays_stop_ids",
        "min_tokens_equals_max",
    ],
)
def test_stop_conditions(params, script, max_model_len, output, reason):
    sched = make_scheduler(8, max_model_len=max_model_len)
    runner = FakeRunner(sched, {"s": script})
    s = make_seq("s", range(10, 18), **params)
    sched.add(s)
    run_to_end(sched, runner)
    assert s.output_token_ids == output
    assert s.finish_reason == reason
    assert s.status == SequenceStatus.FINISHED
    assert s.block_table == []
    assert_all_free(sched)


# -- abort ---------------------------------------------------------------------------------


def test_abort_of_a_running_sequence_frees_its_blocks_at_once():
    sched = make_scheduler(8, budget=4)
    runner = FakeRunner(sched)
    a = make_seq("a", range(9))
    b = make_seq("b", range(20, 23))
    sched.add(a)
    sched.add(b)
    assert step(sched, runner) == ([("a", 4)], [], [])  # mid prefill
    assert a.block_table == [0]
    assert sched.abort("a") is a
    assert (a.status, a.finish_reason, a.block_table) == (SequenceStatus.FINISHED, "abort", [])
    assert sched.running == []
    assert_all_free(sched)
    assert step(sched, runner) == ([("b", 3)], [], [])
    assert sched.abort("a") is None


def test_abort_of_a_waiting_sequence():
    sched = make_scheduler(8)
    a = make_seq("a", range(5))
    sched.add(a)
    assert sched.abort("a") is a
    assert a.finish_reason == "abort"
    assert not sched.has_unfinished()
    assert not sched.schedule()
    assert_all_free(sched)


def test_abort_of_a_preempted_sequence():
    sched = make_scheduler(4)
    runner = FakeRunner(sched)
    a = make_seq("a", range(10, 17), max_tokens=4)
    b = make_seq("b", range(20, 27), max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched, runner)
    step(sched, runner)
    assert step(sched, runner)[1] == ["b"]
    assert sched.abort("b") is b
    assert b.finish_reason == "abort"
    assert list(sched.waiting) == []
    assert sched.abort("a") is a
    assert_all_free(sched)


def test_abort_of_an_unknown_request_is_none():
    assert make_scheduler(4).abort("nope") is None


# -- a random workload ---------------------------------------------------------------------


def random_seqs(rng: random.Random) -> list[Sequence]:
    """14 requests sharing three prefixes, of random lengths (prompt up to 22, output up
    to 20 tokens)."""
    prefixes = [list(range(100 * i, 100 * i + 12)) for i in range(3)]
    seqs = []
    for i in range(14):
        prompt = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randint(3, 99)] * rng.randint(
            0, 10
        )
        seqs.append(make_seq(f"r{i}", prompt, max_tokens=rng.randint(1, 20), ignore_eos=True))
    return seqs


def test_random_workload_finishes_with_every_block_free():
    rng = random.Random(7)
    sched = make_scheduler(10, budget=16, max_num_seqs=6, max_model_len=40)
    runner = FakeRunner(sched)
    seqs = random_seqs(rng)
    pending = list(seqs)
    for _ in range(400):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        step(sched, runner)
    assert not pending and not sched.has_unfinished()
    for s in seqs:
        n = min(s.params.max_tokens, 40 - s.num_prompt_tokens)
        assert s.output_token_ids == [1000 + k for k in range(n)], s.request_id
    assert sched.num_preemptions > 0
    assert sched.kv_cache.prefix_cache_hits > 0
    assert_all_free(sched)


# -- speculative decoding ------------------------------------------------------------------


class ScriptProposer:
    """Proposes the runner's script (what the fake model will draw), wrong at every
    ``wrong_every``-th proposal; ``k`` tokens or fewer."""

    def __init__(self, runner: FakeRunner, seqs: dict[str, Sequence], wrong_every: int = 3):
        self.runner, self.seqs, self.wrong_every, self.calls = runner, seqs, wrong_every, 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        seq = next(s for s in self.seqs.values() if s.token_ids == token_ids)
        self.calls += 1
        drafts = [self.runner.token(seq, j) for j in range(k)]
        if self.calls % self.wrong_every == 0:
            drafts[self.calls % k] = 7  # never a scripted token
        return drafts


def make_speculating(num_blocks: int, seqs: list[Sequence], **kw) -> tuple[Scheduler, FakeRunner]:
    sched = make_scheduler(num_blocks, **kw)
    sched.spec = SpecDecoder(
        SpeculativeConfig(num_speculative_tokens=3, min_acceptance_rate=0),
        sched.config.max_model_len,
    )
    runner = FakeRunner(sched)
    sched.spec.proposer = ScriptProposer(runner, {s.request_id: s for s in seqs})
    return sched, runner


def test_a_speculating_sequence_advances_by_what_was_accepted():
    s = make_seq("s", range(10, 15), max_tokens=12, ignore_eos=True)
    sched, runner = make_speculating(16, [s])
    sched.spec.proposer.wrong_every = 2
    sched.add(s)
    assert step(sched, runner) == ([("s", 5)], [], [])  # the prompt: no drafts
    assert step(sched, runner) == ([("s", 4)], [], [])  # last token + 3 drafts, all right
    assert s.output_token_ids == [1000, 1001, 1002, 1003, 1004]
    assert s.num_computed_tokens == s.num_tokens - 1
    # The third draft wrong: two kept, then the target's own token.
    assert step(sched, runner) == ([("s", 4)], [], [])
    assert s.output_token_ids[5:] == [1005, 1006, 1007]
    assert s.num_computed_tokens == s.num_tokens - 1
    assert len(s.block_table) == cdiv(s.num_tokens, BS)
    run_to_end(sched, runner)
    assert s.output_token_ids == [1000 + k for k in range(12)]  # max_tokens exactly
    assert sched.spec.stats.num_drafts >= 3
    assert_all_free(sched)


def test_the_batch_carries_the_drafts_by_request_and_the_sequence_only_what_was_kept():
    s = make_seq("s", range(10, 15), max_tokens=12, ignore_eos=True)
    sched, runner = make_speculating(16, [s])
    sched.add(s)
    step(sched, runner)
    batch = sched.schedule()
    assert batch.draft_token_ids == {"s": [1001, 1002, 1003]}
    assert (batch.seqs, batch.num_new_tokens) == ([s], [4])
    assert s.token_ids == [*range(10, 15), 1000]  # drafts are not the sequence's yet
    sched.update(batch, ModelRunnerOutput([[1001, 1002, 9]], [[None] * 3]))
    assert s.output_token_ids == [1000, 1001, 1002, 9]
    assert s.num_computed_tokens == s.num_tokens - 1
    assert sched.schedule().draft_token_ids == {"s": [1004, 1005, 1006]}  # proposed afresh


def test_drafts_stop_at_a_stop_token_and_never_pass_max_tokens():
    s = make_seq("s", range(10, 14), max_tokens=30)
    sched, runner = make_speculating(16, [s])
    runner.scripts["s"] = [5, 6, 7, EOS, 9, 9, 9]
    sched.spec.proposer.wrong_every = 1000
    sched.add(s)
    run_to_end(sched, runner)
    assert s.output_token_ids == [5, 6, 7, EOS] and s.finish_reason == "stop"
    assert_all_free(sched)


def test_without_room_for_the_drafts_a_sequence_decodes_alone():
    """Two blocks of 4 tokens: the drafts do not fit, so no draft is scheduled and nothing
    is preempted for them."""
    s = make_seq("s", range(10, 16), max_tokens=2, ignore_eos=True)
    sched, runner = make_speculating(2, [s])
    sched.add(s)
    step(sched, runner)
    assert step(sched, runner) == ([("s", 1)], [], ["s"])
    assert sched.num_preemptions == 0
    assert_all_free(sched)


def test_random_workload_with_speculation_finishes_exactly_with_every_block_free():
    rng = random.Random(17)
    seqs = random_seqs(rng)
    sched, runner = make_speculating(10, seqs, budget=16, max_num_seqs=6, max_model_len=40)
    pending = list(seqs)
    for _ in range(400):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        step(sched, runner)
        for s in sched.running:
            if s.num_computed_tokens:
                assert len(s.block_table) <= cdiv(s.num_tokens, BS)
    assert not pending and not sched.has_unfinished()
    for s in seqs:
        n = min(s.params.max_tokens, 40 - s.num_prompt_tokens)
        assert s.output_token_ids == [1000 + k for k in range(n)], s.request_id
    stats = sched.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sched.num_preemptions > 0
    assert sched.kv_cache.prefix_cache_hits > 0
    assert_all_free(sched)
