"""SamplingParams validation and the Sampler on the CPU: filters, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.core.sampling import MAX_LOGPROBS, SamplingParams
from pdserve.engine.sampler import Sampler, apply_penalties
from pdserve.engine.sequence import Sequence
from pdserve.v1 import common_pb2
from pdserve.wire.convert import sampling_from_proto, sampling_to_proto

NAN = float("nan")

# -- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=NAN), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=101.0), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=NAN), "top_p"),
        (dict(top_p=True), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=NAN), "min_p"),
        (dict(min_p=False), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=(5, -1)), "stop_token_ids"),
        (dict(stop_token_ids=("a",)), "stop_token_ids"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=-2.01), "presence_penalty"),
        (dict(presence_penalty=NAN), "presence_penalty"),
        (dict(presence_penalty=True), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(frequency_penalty=math.inf), "frequency_penalty"),
        (dict(frequency_penalty="1"), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=2.5), "repetition_penalty"),
        (dict(repetition_penalty=NAN), "repetition_penalty"),
        (dict(repetition_penalty=False), "repetition_penalty"),
        (dict(logprobs=0, logprob_token_ids=()), "logprob_token_ids"),
        (dict(logprobs=0, logprob_token_ids=(1, -2)), "logprob_token_ids"),
        (dict(logprobs=0, logprob_token_ids=tuple(range(129))), "logprob_token_ids"),
        (dict(logprob_token_ids=(3,)), "logprob_token_ids"),
    ],
)
def test_sampling_params_reject_nonsense_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("name", ["max_tokens", "top_k", "logprobs", "seed"])
def test_sampling_params_reject_bool_for_integers(name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**{name: True})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=100.0),
        dict(top_p=1.0, top_k=-1, min_p=0.0),
        dict(top_k=0, min_p=1.0),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(seed=0),
        dict(seed=2**63 - 1),
        dict(max_tokens=1, min_tokens=1),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(presence_penalty=2, frequency_penalty=-2),
        dict(repetition_penalty=0.01),
        dict(repetition_penalty=2.0),
    ],
)
def test_sampling_params_accept_edges(kwargs):
    SamplingParams(**kwargs)


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        (dict(), False),
        (dict(temperature=0.0), True),
        (dict(temperature=0), True),
        (dict(top_k=1), True),
        (dict(top_k=2), False),
        (dict(temperature=1e-3), False),
    ],
)
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


# -- Sampler -------------------------------------------------------------------------------


def seq(request_id: str = "s", **params) -> Sequence:
    return Sequence(request_id, [1], SamplingParams(**params))


def logits_of(probs: list[float]) -> torch.Tensor:
    """[vocab] logits whose softmax is ``probs``."""
    return torch.tensor(probs).log()


def draws(row: torch.Tensor, s: Sequence, n: int = 1000) -> torch.Tensor:
    """``n`` tokens drawn for the same row (one batch of ``n`` rows)."""
    tokens, _, _ = Sampler(seed=0)(row.expand(n, -1), [s] * n)
    return torch.tensor(tokens)


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs, _ = Sampler()(logits, [seq(str(i), temperature=0.0) for i in range(6)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 6


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    tokens, _, _ = Sampler()(logits, [seq(str(i), temperature=1.5, top_k=1) for i in range(4)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_draws_only_the_k_best():
    row = logits_of([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])
    assert set(draws(row, seq(top_k=2)).tolist()) == {1, 3}


def test_temperature_one_without_filters_draws_everything():
    row = logits_of([0.4, 0.3, 0.2, 0.1])
    counts = torch.bincount(draws(row, seq()), minlength=4) / 1000
    assert torch.allclose(counts, torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.06)


@pytest.mark.parametrize(
    "probs, best, second",
    [([0.5, 0.3, 0.15, 0.05], 0, 1), ([0.15, 0.5, 0.05, 0.3], 1, 3)],
)
def test_top_p_keeps_the_smallest_set_covering_p(probs, best, second):
    tokens = draws(logits_of(probs), seq(top_p=0.7))
    assert set(tokens.tolist()) == {best, second}
    # Renormalised over the kept tokens: 0.5 / 0.8.
    assert abs((tokens == best).float().mean().item() - 0.625) < 0.06


def test_top_p_keeps_the_best_token_even_when_it_alone_covers_p():
    row = logits_of([0.05, 0.9, 0.05])
    assert set(draws(row, seq(top_p=0.5)).tolist()) == {1}


def test_min_p_drops_tokens_below_min_p_times_the_best():
    row = logits_of([0.5, 0.3, 0.15, 0.05])
    assert set(draws(row, seq(min_p=0.35)).tolist()) == {0, 1}  # cut at 0.175
    assert set(draws(row, seq(min_p=0.25)).tolist()) == {0, 1, 2}  # cut at 0.125


def test_temperature_sharpens_the_distribution():
    row = logits_of([0.6, 0.4])
    hot = (draws(row, seq(temperature=1.0)) == 0).float().mean().item()
    cold = (draws(row, seq(temperature=0.1)) == 0).float().mean().item()
    assert abs(hot - 0.6) < 0.06
    assert cold > 0.96  # 0.6**10 / (0.6**10 + 0.4**10) = 0.983


@pytest.mark.parametrize("others_seeded", [True, False])
def test_seeded_sequence_draws_the_same_tokens_alone_or_in_a_batch(others_seeded):
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, 64, generator=gen)
    alone = seq("alone", seed=1234)
    batched = seq("batched", seed=1234)
    others = [seq(f"o{i}", seed=i if others_seeded else None) for i in range(15)]
    sampler = Sampler(seed=0)
    alone_tokens, batched_tokens = [], []
    for _ in range(20):
        (token,) = sampler(row, [alone])[0]
        alone.append_token(token)  # as the engine does: the next draw is the next step's
        alone_tokens.append(token)
        logits = torch.randn(16, 64, generator=gen)
        logits[5] = row[0]
        batch = [*others[:5], batched, *others[5:]]
        token = sampler(logits, batch)[0][5]
        batched.append_token(token)
        batched_tokens.append(token)
    assert batched_tokens == alone_tokens
    assert len(set(alone_tokens)) > 5  # the test is not trivially deterministic


def test_unseeded_sequences_follow_the_sampler_seed():
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    first, second = Sampler(seed=9), Sampler(seed=9)
    a = [first(row, [seq()])[0][0] for _ in range(10)]
    b = [second(row, [seq()])[0][0] for _ in range(10)]
    assert a == b
    assert len(set(a)) > 3


def test_logprobs_of_the_sampled_token_and_the_top_n():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=gen)
    seqs = [seq("a", logprobs=3), seq("b"), seq("c", temperature=0.0, logprobs=0)]
    tokens, logprobs, _ = Sampler(seed=0)(logits, seqs)
    expected = torch.log_softmax(logits, dim=-1)

    a = logprobs[0]
    assert a is not None
    assert a.token_id == tokens[0]
    assert a.logprob == pytest.approx(expected[0, tokens[0]].item(), abs=1e-6)
    top_ids = expected[0].argsort(descending=True)[:3].tolist()
    assert list(a.top) == top_ids
    assert list(a.top.values()) == pytest.approx(expected[0, top_ids].tolist(), abs=1e-6)
    assert list(a.top.values()) == sorted(a.top.values(), reverse=True)

    assert logprobs[1] is None
    c = logprobs[2]
    assert c is not None
    assert c.token_id == tokens[2] == logits[2].argmax().item()
    assert c.logprob == pytest.approx(expected[2].max().item(), abs=1e-6)
    assert c.top == {}


def test_logprob_token_ids_give_those_ids_and_the_chosen_one_in_place_of_the_top_n():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(7))
    seqs = [
        seq("a", temperature=0.0, logprobs=5, logprob_token_ids=(39, 3, 3)),
        seq("b", temperature=0.0, logprobs=2),
    ]
    tokens, logprobs, _ = Sampler(seed=0)(logits, seqs)
    expected = torch.log_softmax(logits, dim=-1)
    a, b = logprobs
    assert set(a.top) == {3, 39, tokens[0]}
    for token, value in a.top.items():
        assert value == pytest.approx(expected[0, token].item(), abs=1e-6)
    assert list(b.top) == expected[1].argsort(descending=True)[:2].tolist()  # its own top-n
    sent = SamplingParams(logprobs=0, logprob_token_ids=[39, 3])
    assert sampling_from_proto(sampling_to_proto(sent)).logprob_token_ids == (39, 3)
    assert 39 in sent.token_ids_used()  # checked against the vocabulary on the worker


def test_logprobs_are_of_the_unscaled_logits():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(6))
    tokens, logprobs, _ = Sampler()(logits, [seq(temperature=0.3, top_k=3, logprobs=2)])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert logprobs[0].logprob == pytest.approx(expected[tokens[0]].item(), abs=1e-6)


# -- penalties -----------------------------------------------------------------------------


def with_outputs(prompt: list[int], outputs: list[int], **params) -> Sequence:
    s = Sequence("p", prompt, SamplingParams(**params))
    for t in outputs:
        s.append_token(t)
    return s


# Token 0 is in the prompt; 1 was generated twice, 2 once (and is in the prompt too).
ROW = [2.0, 3.0, -1.0, 4.0, -2.0, 0.5]
PROMPT, OUTPUTS = [0, 2], [1, 2, 1]


@pytest.mark.parametrize(
    "params, expected",
    [
        # Seen in the prompt or the output: positive / 2, negative * 2; unseen untouched.
        (dict(repetition_penalty=2.0), [1.0, 1.5, -2.0, 4.0, -2.0, 0.5]),
        (dict(repetition_penalty=0.5), [4.0, 6.0, -0.5, 4.0, -2.0, 0.5]),
        # Output tokens only: minus penalty * count.
        (dict(frequency_penalty=0.5), [2.0, 2.0, -1.5, 4.0, -2.0, 0.5]),
        (dict(frequency_penalty=-1.0), [2.0, 5.0, 0.0, 4.0, -2.0, 0.5]),
        # Output tokens only: minus penalty once, whatever the count.
        (dict(presence_penalty=1.5), [2.0, 1.5, -2.5, 4.0, -2.0, 0.5]),
        # Repetition first, then frequency and presence.
        (
            dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, 0.25, -2.75, 4.0, -2.0, 0.5],
        ),
    ],
)
def test_penalties_give_exact_logits(params, expected):
    s = with_outputs(PROMPT, OUTPUTS, **params)
    out = apply_penalties(torch.tensor([ROW]), [s])
    assert out[0].tolist() == expected


def test_rows_without_penalties_are_bit_identical():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(7))
    plain = [with_outputs([3, 4], [5, 5, 6], temperature=0.0) for _ in range(2)]
    penalized = [
        with_outputs([3, 4], [5, 5, 6], repetition_penalty=1.3),
        with_outputs([7], [8, 9], frequency_penalty=0.7, presence_penalty=-0.4),
    ]
    seqs = [plain[0], penalized[0], plain[1], penalized[1]]
    out = apply_penalties(logits, seqs)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert not torch.equal(out[1], logits[1])
    assert not torch.equal(out[3], logits[3])
    assert apply_penalties(logits, plain + plain) is logits


def test_each_row_counts_its_own_tokens():
    logits = torch.zeros(2, 4) + 1.0
    seqs = [
        with_outputs([0], [1, 1], frequency_penalty=1.0),
        with_outputs([3], [2], frequency_penalty=1.0),
    ]
    assert apply_penalties(logits, seqs).tolist() == [[1.0, -1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]]


def test_greedy_is_penalized_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    s = with_outputs([2], [0], temperature=0.0, frequency_penalty=2.0, logprobs=1)
    tokens, logprobs, _ = Sampler()(logits, [s])
    assert tokens == [1]  # 5 - 2 < 4
    expected = torch.log_softmax(logits[0], dim=-1)
    assert logprobs[0].logprob == pytest.approx(expected[1].item(), abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_penalties_on_cuda_logits():
    s = with_outputs(PROMPT, OUTPUTS, repetition_penalty=2.0, frequency_penalty=0.5)
    out = apply_penalties(torch.tensor([ROW], device="cuda"), [s])
    assert out[0].tolist() == [1.0, 0.5, -2.5, 4.0, -2.0, 0.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampler_draws_from_cuda_logits():
    logits = torch.randn(2, 32, device="cuda")
    tokens, _, _ = Sampler()(logits, [seq("a"), seq("b", seed=1)])
    assert all(0 <= t < 32 for t in tokens)


# -- on the wire ---------------------------------------------------------------------------


def test_penalties_travel_from_gateway_to_worker():
    sent = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25)
    proto = sampling_to_proto(sent)
    for received in (sampling_from_proto(proto), sampling_from_proto(proto, 16)):
        assert received.presence_penalty == 0.5
        assert received.frequency_penalty == -1.0
        assert received.repetition_penalty == 1.25


def test_proto3_zero_penalties_mean_off():
    proto = common_pb2.SamplingParams()
    for received in (sampling_from_proto(proto), sampling_from_proto(proto, 16)):
        assert not received.has_penalties
        assert received.repetition_penalty == 1.0


# -- one row's fault is its own ------------------------------------------------------------


def test_a_temperature_below_epsilon_is_greedy():
    s = seq(temperature=1e-30)
    assert s.params.greedy
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    tokens, _, errors = Sampler()(logits, [s])
    assert tokens == [1] and errors == [None]


def _healthy_batch() -> list[Sequence]:
    """Seeded sampled rows and a greedy one: their tokens depend on nothing else."""
    return [seq(f"h{i}", seed=i, temperature=0.8, top_p=0.9) for i in range(5)] + [
        seq("g", temperature=0.0)
    ]


def _tokens_without(logits: torch.Tensor, bad_row: int) -> list[int]:
    rows = [i for i in range(logits.shape[0]) if i != bad_row]
    tokens, _, errors = Sampler(seed=3)(logits[rows], _healthy_batch())
    assert errors == [None] * len(rows)
    return tokens


@pytest.mark.parametrize("where", [0, 3, 6])
def test_poisonous_sampling_values_fail_only_their_row(where):
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)) * 4
    # A repetition penalty this small overflows the seen tokens' logits to inf: the row's
    # probabilities are NaN.
    poison = Sequence(
        "poison",
        [int(logits[where].argmax())],
        SamplingParams(temperature=0.7, repetition_penalty=1e-38),
    )
    batch = _healthy_batch()
    batch.insert(where, poison)
    tokens, logprobs, errors = Sampler(seed=3)(logits, batch)
    assert tokens[where] is None and logprobs[where] is None
    assert errors[where].invalid and "repetition_penalty=1e-38" in errors[where].message
    others = tokens[:where] + tokens[where + 1 :]
    assert others == _tokens_without(logits, where)
    assert all(e is None for i, e in enumerate(errors) if i != where)


def test_non_finite_logits_of_one_row_are_a_fault_of_that_row_only():
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    logits[2, 10] = NAN
    batch = _healthy_batch()
    batch.insert(2, seq("nan", temperature=0.0))
    tokens, _, errors = Sampler(seed=3)(logits, batch)
    assert tokens[2] is None and not errors[2].invalid and "not finite" in errors[2].message
    assert tokens[:2] + tokens[3:] == _tokens_without(logits, 2)


def test_a_fault_in_one_rows_sampling_leaves_the_others_as_they_were():
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    batch = _healthy_batch()
    batch.insert(4, seq("faulty", seed=9, temperature=1.0, logprobs=2))
    sampler = Sampler(seed=3)

    def fault(s: Sequence) -> None:
        if s.request_id == "faulty":
            raise RuntimeError("injected")

    sampler.fault = fault
    tokens, logprobs, errors = sampler(logits, batch)
    assert tokens[4] is None and logprobs[4] is None
    assert "injected" in errors[4].message and not errors[4].invalid
    assert tokens[:4] + tokens[5:] == _tokens_without(logits, 4)


# -- top-p among the most probable tokens first --------------------------------------------


def test_top_p_among_candidates_keeps_what_the_whole_sort_keeps():
    from pdserve.engine.sampler import TOP_P_CANDIDATES, _top_p_by_sort, top_p_filtered

    gen = torch.Generator().manual_seed(11)
    # Peaked rows (their nucleus is among the first candidates) and flat ones (it is not),
    # with top_p 1 (off) among them.
    scales = torch.tensor([8.0, 3.0, 0.05, 12.0, 0.5, 1.0, 0.01, 6.0]).repeat(4)
    logits = torch.randn(len(scales), 4096, generator=gen) * scales[:, None]
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 1.0, 0.7, 0.3, 0.999]).repeat_interleave(4)
    got = top_p_filtered(logits, top_p)
    on = top_p < 1.0
    want = logits.clone()
    want[on] = _top_p_by_sort(logits[on], top_p[on])
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], logits[~got.isinf()])
    kept = (~got.isinf()).sum(dim=-1)
    assert (kept[on] < TOP_P_CANDIDATES).any() and (kept[on] > TOP_P_CANDIDATES).any()
    assert (kept[~on] == 4096).all()
