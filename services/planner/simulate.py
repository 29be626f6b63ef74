"""A cluster simulated on a profile: requests arrive, are prefilled (on a prefill worker, or
on a decode worker among its decode rows), handed over, and decoded in continuous batches;
what the clients would measure comes out (each request's TTFT, every inter-token gap).

The model follows the engine and the gateway:
- a prefill worker serves its queue first come, first served, one prompt taking the
  profile's time to first token; the gateway gives each prompt to the prefill worker that
  will be free first;
- a decode worker steps while it has work: each step every running sequence (up to
  ``max_num_seqs``) gets a token, and prompts it prefills itself take chunks of what is
  left of ``max_num_batched_tokens``; a step costs the profile's decode step for its batch
  and context (drawn around it by the profile's measured spread), and with chunks in it
  their prefill compute plus what the decode rows add to it (the step less a batch of
  one's, which the prefill pays already);
- a request prefilled elsewhere joins a decode worker the hand-over time after its first
  token, at that worker's next step; the gateway picks the decode worker with the fewest
  requests.
Arrivals are a Poisson process, lengths uniform in [len*(1-r), len*(1+r)], as
`pdserve bench serve --workload random` sends them.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from pdserve.planner.model import Profile, percentile


@dataclass(frozen=True)
class Traffic:
    """Requests per second and their lengths."""

    request_rate: float
    prompt_len: int
    output_len: int
    range_ratio: float = 0.0
    num_prompts: int = 400

    def lengths(self, rng: random.Random, mean: int) -> int:
        if self.range_ratio <= 0:
            return mean
        lo = max(int(mean * (1 - self.range_ratio)), 1)
        return rng.randint(lo, max(int(mean * (1 + self.range_ratio)), lo))

    def describe(self) -> str:
        spread = f" (±{self.range_ratio:.0%})" if self.range_ratio else ""
        return (
            f"{self.request_rate:g} req/s, prompts of {self.prompt_len}{spread} tokens, "
            f"outputs of {self.output_len}{spread}"
        )


@dataclass(frozen=True)
class Cluster:
    """Replicas per pool; with no prefill worker the decode workers prefill every prompt."""

    prefill: int
    decode: int
    local_prefill_threshold: int = 0  # prompts shorter than this are prefilled on decode

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    def describe(self) -> str:
        if not self.prefill:
            return f"{self.decode} decode (colocated)"
        local = (
            f", prompts under {self.local_prefill_threshold} tokens prefilled on decode"
            if self.local_prefill_threshold
            else ""
        )
        return f"{self.prefill} prefill + {self.decode} decode{local}"


@dataclass
class Prediction:
    """What the clients would see, in ms."""

    ttft_ms: list[float]
    itl_ms: list[float]
    duration_s: float
    completed: int
    arrival_ms: list[float] = field(default_factory=list)

    def ttft(self, p: float) -> float:
        return percentile(self.ttft_ms, p)

    def itl(self, p: float) -> float:
        return percentile(self.itl_ms, p)

    def summary(self) -> dict:
        return {
            "ttft_ms": {"p50": self.ttft(50), "p90": self.ttft(90), "p99": self.ttft(99)},
            "itl_ms": {"p50": self.itl(50), "p90": self.itl(90), "p99": self.itl(99)},
            "duration_s": self.duration_s,
            "completed": self.completed,
        }


@dataclass
class _Request:
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0  # prompt tokens computed (on a decode worker)
    remaining: int = 0  # tokens still to generate
    context: int = 0
    last_token: float = 0.0
    first_token: float | None = None


@dataclass
class _Decoder:
    index: int
    running: list = field(default_factory=list)
    prefilling: deque = field(default_factory=deque)  # prompts it prefills itself
    joining: deque = field(default_factory=deque)  # prefilled elsewhere, KV arrived
    busy: bool = False
    pending: int = 0  # routed here, hand-over under way

    @property
    def load(self) -> int:
        return len(self.running) + len(self.prefilling) + len(self.joining) + self.pending


def simulate(profile: Profile, cluster: Cluster, traffic: Traffic, seed: int = 0) -> Prediction:
    """Run ``traffic`` through ``cluster`` on ``profile``'s costs."""
    # Arrivals drawn as `pdserve bench serve --seed` draws them (the same seed: the same
    # times); lengths and step spread from generators of their own.
    arrivals, rng = random.Random(seed), random.Random(f"{seed}-lengths-steps")
    requests, now = [], 0.0
    for _ in range(traffic.num_prompts):
        prompt = traffic.lengths(rng, traffic.prompt_len)
        output = traffic.lengths(rng, traffic.output_len)
        requests.append(_Request(now, prompt, output, remaining=output, context=prompt))
        now += arrivals.expovariate(traffic.request_rate) * 1000.0  # ms
    decoders = [_Decoder(i) for i in range(cluster.decode)]
    prefill_free = [0.0] * cluster.prefill
    itl: list[float] = []
    events: list = []  # (time, order, kind, payload)
    order = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, payload))

    for r in requests:
        push(r.arrival, "arrive", r)
    finished = 0
    overhead = profile.overhead_ms

    def start_step(d: _Decoder, t: float) -> None:
        while d.joining and len(d.running) < profile.max_num_seqs:
            d.running.append(d.joining.popleft())
        rows = d.running[: profile.max_num_seqs]
        budget = profile.max_num_batched_tokens - len(rows)
        chunks, cost = [], 0.0
        seats = profile.max_num_seqs - len(rows)
        for r in d.prefilling:
            if budget <= 0 or seats <= 0:
                break
            take = min(r.prompt - r.prefilled, budget)
            chunks.append((r, take))
            cost += profile.chunk_ms(r.prefilled, r.prefilled + take)
            budget -= take
            seats -= 1
        if not rows and not chunks:
            d.busy = False
            return
        d.busy = True
        if rows:
            step = profile.step_ms(len(rows), sum(r.context for r in rows))
            if chunks:
                # One forward for both: the step's fixed part (a batch of one's step: the
                # weights read, the framework) is in the chunks' prefill time already.
                step -= profile.decode.y[0]
            cost += max(step, 0.0) * profile.jitter_at(rng.random())
        push(t + cost, "step", (d, rows, chunks))

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":  # at the gateway
            r = payload
            local = not cluster.prefill or r.prompt < cluster.local_prefill_threshold
            if local:
                push(t + overhead, "local", r)
            else:
                k = min(range(cluster.prefill), key=lambda k: (prefill_free[k], k))
                done = max(t + overhead, prefill_free[k]) + profile.service_ms(r.prompt)
                prefill_free[k] = done
                push(done, "prefilled", r)
        elif kind == "local":  # at a decode worker, to prefill there
            r = payload
            d = min(decoders, key=lambda d: (d.load, d.index))
            d.prefilling.append(r)
            if not d.busy:
                start_step(d, t)
        elif kind == "prefilled":
            r = payload
            r.first_token = r.last_token = t
            r.remaining -= 1
            r.context += 1
            if r.remaining <= 0:
                finished += 1
                continue
            d = min(decoders, key=lambda d: (d.load, d.index))
            d.pending += 1
            push(t + profile.handover_ms(r.prompt), "join", (d, r))
        elif kind == "join":
            d, r = payload
            d.pending -= 1
            d.joining.append(r)
            if not d.busy:
                start_step(d, t)
        else:  # step
            d, rows, chunks = payload
            for r in rows:
                itl.append(t - r.last_token)
                r.last_token = t
                r.context += 1
                r.remaining -= 1
            for r, take in chunks:
                r.prefilled += take
                if r.prefilled >= r.prompt:
                    d.prefilling.remove(r)
                    r.first_token = r.last_token = t
                    r.remaining -= 1
                    r.context += 1
                    if r.remaining > 0:
                        d.running.append(r)
                    else:
                        finished += 1
            done = [r for r in rows if r.remaining <= 0]
            for r in done:
                d.running.remove(r)
            finished += len(done)
            start_step(d, t)
    ttft = [r.first_token - r.arrival for r in requests if r.first_token is not None]
    end = max((r.last_token for r in requests), default=0.0)
    return Prediction(ttft, itl, end / 1000.0, finished, [r.arrival for r in requests])
