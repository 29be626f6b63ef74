"""The async request runner: sends a workload's sessions to an OpenAI-compatible server.

Requests stream (`stream: true` with `include_usage`) through one shared
httpx.AsyncClient. Sessions start at Poisson arrival times (exponential gaps at
`request_rate` per second, seeded; all at once for `inf`); a session's turns run
one after another, each resending the history with the model's actual replies.
At most `max_concurrency` requests are in flight.

Token chunks are those with `choices`, as vLLM's client counts them, except a chat
stream's role announcement (a delta with a role and no content), which carries no
token. A request fails on an HTTP error, an error event in the stream, a
transport error or timeout, or a stream without any token chunk; its record says why.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.workloads import Session, Turn

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_TEXT_CHARS = 500


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send the requests."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    extra_body: tuple[tuple[str, object], ...] = ()  # more request fields, sent as they are


@dataclass(frozen=True)
class RunResult:
    """Per-request records (session order, then turn order) and the run's duration."""

    records: list[RequestRecord]
    duration_s: float


def num_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


def arrival_times(count: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `count` sessions starts (vLLM's Poisson process)."""
    if request_rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


async def run_sessions(
    config: ClientConfig,
    sessions: list[Session],
    on_done: Callable[[RequestRecord], None] = lambda record: None,
) -> RunResult:
    """Send every session's turns and return what each request did."""
    if config.endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {config.endpoint!r}; use {', '.join(ENDPOINTS)}")
    size = max(1, config.max_concurrency or num_requests(sessions))
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    slots = asyncio.Semaphore(size)
    arrivals = arrival_times(len(sessions), config.request_rate, config.seed)
    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/").removesuffix("/v1"),  # either form works
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(config.timeout_s),
    ) as http:
        runner = _Runner(config, http, slots, on_done, time.perf_counter())
        per_session = await asyncio.gather(
            *(
                runner.session(i, s, at)
                for i, (s, at) in enumerate(zip(sessions, arrivals, strict=True))
            )
        )
        duration = time.perf_counter() - runner.t0
    return RunResult([r for records in per_session for r in records], duration)


class _Runner:
    """Sends sessions over one client, holding a concurrency slot per request."""

    def __init__(
        self,
        config: ClientConfig,
        http: httpx.AsyncClient,
        slots: asyncio.Semaphore,
        on_done: Callable[[RequestRecord], None],
        t0: float,
    ):
        self.config = config
        self.http = http
        self.slots = slots
        self.on_done = on_done
        self.t0 = t0  # perf_counter() at the start of the run

    async def session(self, index: int, session: Session, at: float) -> list[RequestRecord]:
        await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
        history: list[tuple[str, str]] = []
        records = []
        for number, turn in enumerate(session.turns):
            record = RequestRecord(
                session=index,
                turn=number,
                input_len=turn.input_len + sum(_prior_len(t) for t in session.turns[:number]),
                expected_output_len=turn.output_len,
                kind=turn.kind,
            )
            if records and not records[-1].success:
                record.error = f"not sent: turn {number - 1} of this conversation failed"
            else:
                async with self.slots:
                    reply = await self.request(self.payload(session, history, turn), record)
                history.append((turn.text, reply))
            records.append(record)
            self.on_done(record)
        return records

    def payload(self, session: Session, history: list[tuple[str, str]], turn: Turn) -> dict:
        body: dict = {
            "model": self.config.model,
            "max_tokens": turn.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.config.extra_body)
        if self.config.endpoint == "chat":
            body["messages"] = _messages(session, history, turn)
        else:
            parts = [session.system] if session.system else []
            parts += [text for exchange in history for text in exchange] + [turn.text]
            body["prompt"] = "\n".join(parts)
        return body

    async def request(self, body: dict, record: RequestRecord) -> str:
        """Stream one request into `record`; returns the generated text."""
        url = ENDPOINTS[self.config.endpoint]
        start = time.perf_counter()
        record.start = start - self.t0
        stream = _Stream(record, start, chat=self.config.endpoint == "chat")
        try:
            async with asyncio.timeout(self.config.timeout_s):
                async with self.http.stream("POST", url, json=body) as response:
                    record.status = response.status_code
                    if response.status_code != 200:
                        text = (await response.aread()).decode(errors="replace")
                        record.error = f"HTTP {response.status_code}: {_error_text(text)}"
                        return ""
                    async for line in response.aiter_lines():
                        if not stream.feed(line):
                            break
        except TimeoutError:
            record.error = f"timed out after {self.config.timeout_s:g}s"
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"
        return stream.finish()


class _Stream:
    """Reads one SSE response's lines into a record, timing each token chunk."""

    def __init__(self, record: RequestRecord, start: float, chat: bool):
        self.record = record
        self.start = start
        self.chat = chat
        self.last: float | None = None
        self.chunks = 0
        self.usage: dict = {}
        self.text: list[str] = []

    def feed(self, line: str) -> bool:
        """Take one line; False once the stream is over (`[DONE]` or an error event)."""
        if not line.startswith("data:"):
            return True  # blank lines, comments (pings) and other SSE fields
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return False
        now = time.perf_counter()
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.record.error = f"not JSON in the stream: {_error_text(data)}"
            return False
        if "error" in event:
            self.record.error = f"stream error: {_error_text(json.dumps(event['error']))}"
            return False
        if event.get("choices"):
            self._choice(event["choices"][0], now)
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        return True

    def _choice(self, choice: dict, now: float) -> None:
        if self.chat:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or ""
            if "role" in delta and not piece and not choice.get("finish_reason"):
                return  # the role announcement, no token
        else:
            piece = choice.get("text") or ""
        if self.last is None:
            self.record.ttft = now - self.start
        else:
            self.record.itl.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.text.append(piece)

    def finish(self) -> str:
        """Close the record: its latency, output length and success; returns the text."""
        record = self.record
        record.e2el = time.perf_counter() - self.start
        record.output_len = self.usage.get("completion_tokens") or self.chunks
        record.server_input_len = self.usage.get("prompt_tokens")
        if not record.error and self.chunks == 0:
            record.error = "the stream carried no token"
        record.success = not record.error
        return "".join(self.text)


def _messages(session: Session, history: list[tuple[str, str]], turn: Turn) -> list[dict]:
    if turn.messages is not None:
        return list(turn.messages)
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for user, reply in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": turn.text}]


def _prior_len(turn: Turn) -> int:
    """Tokens an earlier turn adds to a later prompt: its text and (about) its reply."""
    return turn.input_len + turn.output_len


def _error_text(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself, shortened."""
    try:
        error = json.loads(text)["error"]
        message = error.get("message", text) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = text
    return message.strip()[:_ERROR_TEXT_CHARS]
