"""A cluster under faults: 2 prefill workers, 2 decode workers and 2 kvstore replicas
registered in a real Redis, and a gateway routing from it, each its own process on
127.0.0.1; the five faults of issue 15 and a prefill worker killed in the middle of a
hand-over (issue 40), each followed by the restart a supervisor would make; a seeded load of completions over HTTP; and where the gateway's log says each
request ran. Shared by tests/integration/test_chaos.py and bench/serving/chaos.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.controlplane.view import RegistryView
from pdserve.kv.client import KVStoreClient
from pdserve.local.launcher import Child, free_port
from pdserve.local.redis_server import RedisServer, start_redis
from pdserve.runtime.rpc import aio_channel
from pdserve.testing.cluster import Cluster, decode_idle, decode_stat
from pdserve.testing.metrics import metric
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

# One torch thread each: four engine processes share the machine's cores (more threads
# than cores make oneDNN spin, and steps tens of times slower).
ENGINE = [
    "--dtype",
    "float32",
    "--num-kv-blocks",
    "512",
    "--max-num-seqs",
    "16",
    "--num-threads",
    "1",
]
FAULTS = (
    "decode-kill",
    "decode-stop",
    "prefill-kill",
    "prefill-kill-handover",
    "kvstore-kill",
    "redis-kill",
)
HANDOVER_TOKENS = 16  # generated in the prefill-kill-handover fault's own request
WAIT_S = 60.0  # the longest any one step of a fault (a restart, a rejoin) may take


@dataclass(frozen=True)
class Job:
    """One completion request of the load; ``name`` is its x-request-id."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    seed: int | None  # None: greedy

    @property
    def base(self) -> str:
        """The name of the job this one repeats (``repeated``): its own if none."""
        return self.name.split("~")[0]

    def body(self, model: str) -> dict:
        sampling = (
            {"temperature": 0} if self.seed is None else {"temperature": 0.9, "seed": self.seed}
        )
        return {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": self.stream,
            **sampling,
        }


def make_jobs(n: int, seed: int, lengths: Sequence[int] = (48, 96, 144)) -> list[Job]:
    """``n`` jobs: prompts of 4 families sharing a 2-block prefix (so prefix caches and the
    kvstore both serve), greedy and seeded, streamed and not, in turn."""
    rng = random.Random(seed)
    families = [[rng.randrange(3, 500) for _ in range(32)] for _ in range(4)]
    jobs = []
    for i in range(n):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))]
        jobs.append(
            Job(
                name=f"chaos-{seed}-{i}",
                prompt=tuple(families[i % 4] + tail),
                max_tokens=lengths[rng.randrange(len(lengths))],
                stream=i % 4 < 2,
                seed=None if i % 2 == 0 else 1000 + i,
            )
        )
    return jobs


def repeated(jobs: Sequence[Job], rounds: int | None = None) -> Iterator[Job]:
    """``jobs``, then each again under a new name (``<name>~<round>``, so that the gateway's
    log tells where each request ran), ``rounds`` times in all (None: without end): a load
    that lasts as long as the faults do."""
    for r in itertools.count() if rounds is None else range(rounds):
        for job in jobs:
            yield job if r == 0 else dataclasses.replace(job, name=f"{job.name}~{r}")


def reference_tokens(model_path: Path, jobs: Sequence[Job]) -> dict[str, list[int]]:
    """Each job's tokens from an in-process engine, no fault anywhere (on one torch thread,
    beside the cluster's processes; the process's thread count is restored after)."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    threads = torch.get_num_threads()
    try:
        llm = LLM(
            model=str(model_path),
            dtype="float32",
            num_kv_blocks=4096,
            max_num_seqs=128,
            enforce_eager=True,
            num_threads=1,
        )
        params = [
            SamplingParams(
                max_tokens=j.max_tokens,
                ignore_eos=True,
                temperature=0.0 if j.seed is None else 0.9,
                seed=j.seed,
            )
            for j in jobs
        ]
        outputs = llm.generate([list(j.prompt) for j in jobs], params)
    finally:
        torch.set_num_threads(threads)
    return {j.name: o.token_ids for j, o in zip(jobs, outputs, strict=True)}


@dataclass
class Outcome:
    """What the client got for one job."""

    job: Job
    tokens: list[int]
    finish: str | None
    error: str | None
    started_at: float  # monotonic
    ended_at: float

    @property
    def latency_s(self) -> float:
        return self.ended_at - self.started_at


class Load:
    """Jobs sent by ``concurrency`` HTTP clients at once, one after another, each outcome
    kept; it stops taking jobs when they run out or ``stop`` is set."""

    def __init__(self, url: str, model: str, concurrency: int, timeout_s: float = 120.0):
        self.url, self.model, self.concurrency, self.timeout_s = url, model, concurrency, timeout_s
        self.outcomes: list[Outcome] = []
        self.stop = asyncio.Event()

    async def run(self, jobs: Iterable[Job]) -> list[Outcome]:
        todo = iter(jobs)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s) as client:

            async def client_loop() -> None:
                while not self.stop.is_set():
                    job = next(todo, None)
                    if job is None:
                        return
                    self.outcomes.append(await self._one(client, job))

            await asyncio.gather(*(client_loop() for _ in range(self.concurrency)))
        return self.outcomes

    @contextlib.asynccontextmanager
    async def running(self, jobs: Iterable[Job]) -> AsyncIterator[asyncio.Task]:
        """``run(jobs)`` as a task while inside; cancelled on leaving if not done."""
        task = asyncio.create_task(self.run(jobs))
        try:
            yield task
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def done_between(self, start: float, end: float) -> int:
        """Requests that succeeded within [start, end] (monotonic)."""
        return sum(1 for o in self.outcomes if o.error is None and start <= o.ended_at <= end)

    async def _one(self, client: httpx.AsyncClient, job: Job) -> Outcome:
        started = time.monotonic()
        try:
            tokens, finish = await complete(client, job.body(self.model), job.name)
            error = None
        except Exception as e:  # noqa: BLE001 (every failure is counted, none stops the load)
            tokens, finish, error = [], None, f"{type(e).__name__}: {e}"
        return Outcome(job, tokens, finish, error, started, time.monotonic())


async def complete(client: httpx.AsyncClient, body: dict, request_id: str):
    """(token ids, finish reason) of a completion, streamed or not; raises on any error."""
    headers = {"x-request-id": request_id}
    if not body["stream"]:
        response = await client.post("/v1/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    tokens, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            choice = event["choices"][0]
            tokens.extend(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
    return tokens, finish


# The per-request line ends "on A -> B -> C", then maybe the log context: " [request_id=...]".
_ROUTE = re.compile(
    r"\(client id '(?P<id>[^']+)'\): .*, on (?P<moves>[^\s\[]+(?: -> \S+)*)(?: \[[^\]]*\])?$",
    re.M,
)


def routes(gateway_log: str) -> dict[str, list[str]]:
    """Where each request ran, by client id, from the gateway's per-request log lines:
    ["prefill@A", "decode@B", "decode@C"] (B's stream broke and moved to C)."""
    return {m["id"]: m["moves"].split(" -> ") for m in _ROUTE.finditer(gateway_log)}


def decode_moves(route: Sequence[str]) -> list[tuple[str, str]]:
    """The (from, to) decode worker addresses of each move of a route."""
    decodes = [hop.removeprefix("decode@") for hop in route if hop.startswith("decode@")]
    return list(zip(decodes, decodes[1:], strict=False))


@dataclass
class Fault:
    """One fault as it was made."""

    kind: str  # one of FAULTS
    victim: str  # the service's name
    address: str  # its address when hit
    load: int = 0  # requests on it when hit (decode: running or waiting; prefill: taken
    # in the second before)
    at: float = field(default_factory=time.monotonic)
    recovered_s: float = 0.0  # from the hit until every pool was whole again
    # prefill-kill-handover: its request's prompt and the tokens it got (first included)
    handover: tuple[list[int], list[int]] | None = None


class ChaosCluster:
    """The processes, and the faults made to them."""

    def __init__(
        self,
        model_path: Path,
        log_dir: Path,
        served_model_name: str,
        engine: Sequence[str] = ENGINE,
        stream_idle_timeout_s: float = 3.0,
        registry_ttl_s: float = 2.0,
        worker_env: dict[str, str] | None = None,
        kv_transport: str = "auto",
    ) -> None:
        """``worker_env``: added to the prefill and decode workers' environment;
        ``kv_transport``: their --kv-transport (auto: NIXL where it is installed)."""
        self.model_path, self.served_model_name = model_path, served_model_name
        self.kv_transport = kv_transport
        self.worker_env = worker_env
        self.engine = list(engine)
        self.idle_s, self.ttl_s = stream_idle_timeout_s, registry_ttl_s
        self.cluster = Cluster(log_dir)
        self.redis: RedisServer | None = None
        self.view: RegistryView | None = None
        self.url = ""
        self.faults: list[Fault] = []
        self._stopped: set[str] = set()

    # --- the cluster -----------------------------------------------------------------

    async def start(self) -> None:
        """Redis, the kvstores (on fixed ports, so a restart binds the same), the workers
        (in parallel) and the gateway; returns once the registry lists every one."""
        self.redis = await asyncio.to_thread(start_redis, launcher=self.cluster.launcher)
        registry = ["--redis-url", self.redis.url, "--registry-ttl", f"{self.ttl_s:g}"]
        model = ["--model", str(self.model_path)]
        specs = [
            (f"kvstore-{i}", "pdserve.kvstore", "--port", str(free_port()), *registry)
            for i in range(2)
        ]
        await asyncio.to_thread(self._start_all, specs, None)
        specs = [
            (
                f"{role}-{i}",
                f"pdserve.{role}",
                *registry,
                *model,
                *self.engine,
                *("--kv-transport", self.kv_transport),
            )
            for role in ("prefill", "decode")
            for i in range(2)
        ]
        await asyncio.to_thread(self._start_all, specs, self.worker_env)
        gateway = await asyncio.to_thread(
            self.cluster.start,
            "gateway",
            "pdserve.gateway",
            *("--redis-url", self.redis.url, *model),
            *("--served-model-name", self.served_model_name),
            *("--stream-idle-timeout", f"{self.idle_s:g}"),
        )
        self.url = f"http://{gateway.addresses['gateway-http']}"
        self.view = RegistryView(self.redis.url, refresh_s=0.2)
        await self.view.start()
        await self.whole()

    async def __aenter__(self) -> ChaosCluster:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _start_all(self, specs: list[tuple], env: dict[str, str] | None) -> None:
        with ThreadPoolExecutor(len(specs)) as pool:
            list(pool.map(lambda spec: self.cluster.start(*spec, env=env), specs))

    async def close(self) -> None:
        """Stop every process this cluster started (a frozen one is woken first)."""
        for name in list(self._stopped):
            self.service(name).signal(signal.SIGCONT)
        if self.view is not None:
            await self.view.close()
        await asyncio.to_thread(self.cluster.stop_all)
        if self.redis is not None:
            self.redis.stop()

    def service(self, name: str) -> Child:
        return next(s for s in self.cluster.services if s.name == name)

    def workers(self, role: str) -> list[Child]:
        return [s for s in self.cluster.services if s.name.startswith(f"{role}-")]

    @property
    def gateway(self) -> Child:
        return self.service("gateway")

    async def whole(self, within_s: float = WAIT_S) -> None:
        """Wait until the registry lists exactly the live workers and kvstores, each at its
        current address, and the gateway routes to 2 of each."""
        deadline = time.monotonic() + within_s
        while True:
            want = {
                role: sorted(c.address for c in self.workers(role) if c.alive())
                for role in ("prefill", "decode", "kvstore")
            }
            await self.view.refresh()
            have = {role: sorted(w.address for w in self.view.workers(role)) for role in want}
            if have == want and self.view.redis_ok and await self._gateway_pools() == 2:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"registry {have} is not {want} within {within_s} s")
            await asyncio.sleep(0.1)

    async def _gateway_pools(self) -> int:
        """The smallest of the gateway's three pool sizes."""
        sizes = [
            await asyncio.to_thread(metric, self.url, "pdserve:pool_workers", pool=role)
            for role in ("prefill", "decode", "kvstore")
        ]
        return int(min(sizes))

    async def restart(self, child: Child) -> None:
        """Start ``child``'s command again and wait until the cluster is whole."""

        def again() -> None:
            self.cluster.launcher.restart(child)
            self.cluster.launcher.wait_ready([child], WAIT_S)

        await asyncio.to_thread(again)
        await self.whole()

    async def idle(self, within_s: float = WAIT_S) -> None:
        """Wait until every live decode worker runs nothing and has every block free."""
        for child in self.workers("decode"):
            if child.alive():
                await decode_idle(child.address, within_s, blocks_free=True)

    # --- the faults ------------------------------------------------------------------

    async def hit(self, kind: str) -> Fault:
        """Make the fault ``kind`` (one of FAULTS) and the restart that follows it."""
        fault = await getattr(self, "_" + kind.replace("-", "_"))()
        fault.recovered_s = time.monotonic() - fault.at
        self.faults.append(fault)
        return fault

    async def busiest_decode(self, least: int = 2, within_s: float = WAIT_S) -> tuple[Child, int]:
        """The decode worker with the most requests in flight, once one has ``least``."""
        deadline = time.monotonic() + within_s
        while True:
            counts = []
            for child in self.workers("decode"):
                stat = await decode_stat(child.address)
                counts.append((stat.num_running + stat.num_waiting, child))
            n, child = max(counts, key=lambda c: c[0])
            if n >= least:
                return child, n
            if time.monotonic() > deadline:
                raise AssertionError(f"no decode worker has {least} requests within {within_s} s")
            await asyncio.sleep(0.05)

    async def holds_all(self, child: Child, n: int, within_s: float = WAIT_S) -> None:
        """Wait until decode worker ``child`` has ``n`` requests running or waiting."""
        deadline = time.monotonic() + within_s
        while True:
            stat = await decode_stat(child.address)
            if stat.num_running + stat.num_waiting >= n:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{child.name} holds {stat} after {within_s} s, not {n}")
            await asyncio.sleep(0.1)

    async def _killed(self, kind: str, victim: Child, load: int) -> Fault:
        """SIGKILL ``victim`` and start it again."""
        fault = Fault(kind, victim.name, victim.address, load)
        await asyncio.to_thread(self.cluster.stop, victim, signal.SIGKILL)
        await self.restart(victim)
        return fault

    async def _decode_kill(self) -> Fault:
        return await self._killed("decode-kill", *await self.busiest_decode())

    async def _decode_stop(self) -> Fault:
        victim, n = await self.busiest_decode()
        fault = Fault("decode-stop", victim.name, victim.address, n)
        victim.signal(signal.SIGSTOP)
        self._stopped.add(victim.name)
        try:
            await asyncio.sleep(self.idle_s + 2.0)
        finally:
            victim.signal(signal.SIGCONT)
            self._stopped.discard(victim.name)
        await self.whole()
        return fault

    async def busiest_prefill(self, within_s: float = WAIT_S) -> tuple[Child, int]:
        """The prefill worker that took the most requests in the last second (by the
        registry's heartbeats), once one took any."""
        deadline = time.monotonic() + within_s
        while True:
            before = {w.address: w.requests_total for w in self.view.workers("prefill")}
            await asyncio.sleep(1.0)
            after = {w.address: w.requests_total for w in self.view.workers("prefill")}
            taken = {a: n - before[a] for a, n in after.items() if a in before}
            address = max(taken, key=taken.get, default=None)
            if address is not None and taken[address] > 0:
                victim = next(c for c in self.workers("prefill") if c.address == address)
                return victim, taken[address]
            if time.monotonic() > deadline:
                raise AssertionError(f"no prefill worker took a request within {within_s} s")

    async def _prefill_kill(self) -> Fault:
        return await self._killed("prefill-kill", *await self.busiest_prefill())

    async def _prefill_kill_handover(self) -> Fault:
        """A prefill worker SIGKILLed between its answer and the decode worker's read of
        the prompt's blocks (staged in its memory over NIXL; over gRPC, pushed): the decode
        worker falls back to the kvstore, else recomputes. The request is this fault's own
        (a random prompt, greedy), sent to the workers directly so that the kill falls in
        that window every time; its tokens go in ``Fault.handover`` for the test to check."""
        victim = self.workers("prefill")[len(self.faults) % 2]
        rng = random.Random(len(self.faults))
        prompt = [rng.randrange(3, 512) for _ in range(70)]
        request = prefill_pb2.PrefillRequest(
            request_id=f"handover-{len(self.faults)}",
            prompt_token_ids=prompt,
            params=common_pb2.SamplingParams(
                max_tokens=HANDOVER_TOKENS, temperature=0, ignore_eos=True
            ),
            decode_reads_nixl=self.reads_over_nixl(),
        )
        async with aio_channel(victim.address) as channel:
            answer = await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=WAIT_S)
        fault = Fault("prefill-kill-handover", victim.name, victim.address, 1)
        await asyncio.to_thread(self.cluster.stop, victim, signal.SIGKILL)
        handed = decode_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            params=request.params,
            first_token_id=answer.first_token_id,
            block_keys=answer.block_keys,
            kvstore_address=answer.kvstore_address,
            block_kvstore_addresses=answer.block_kvstore_addresses,
            layout=answer.layout,
            nixl=answer.nixl if answer.HasField("nixl") else None,
        )
        decode = next(d for d in self.workers("decode") if d.name not in self._stopped)
        tokens = [answer.first_token_id]
        async with aio_channel(decode.address) as channel:
            async for out in decode_pb2_grpc.DecodeStub(channel).Decode(handed, timeout=WAIT_S):
                tokens.extend(out.token_ids)
        fault.handover = (prompt, tokens)
        await self.restart(victim)
        return fault

    def reads_over_nixl(self) -> bool:
        """Whether the decode workers said they read KV over NIXL."""
        return any("KV transport nixl" in d.log_text() for d in self.workers("decode"))

    async def _kvstore_kill(self) -> Fault:
        """SIGKILL a replica, leave it down past its registry TTL, start it again on the same
        port; recovered once it has taken blocks from a prefill worker and given blocks to a
        decode worker again."""
        victim = self.workers("kvstore")[len(self.faults) % 2]
        fault = Fault("kvstore-kill", victim.name, victim.address)
        await asyncio.to_thread(self.cluster.stop, victim, signal.SIGKILL)
        await asyncio.sleep(2 * self.ttl_s)
        await self.restart(victim)
        deadline = time.monotonic() + WAIT_S
        async with KVStoreClient(victim.address) as client:
            while True:
                stat = await client.stat(timeout=10)
                # Decode workers that read over NIXL fetch from a kvstore only as a fallback.
                if stat.blocks_in > 0 and (stat.blocks_out > 0 or self.reads_over_nixl()):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{victim.name} unused since its restart: {stat}")
                await asyncio.sleep(0.1)
        return fault

    async def _redis_kill(self) -> Fault:
        """SIGKILL Redis, leave it down past every TTL, start it again (empty) on the same
        port; recovered once every worker and kvstore has registered again."""
        fault = Fault("redis-kill", "redis", f"127.0.0.1:{self.redis.port}")
        with contextlib.suppress(ProcessLookupError):
            self.redis.child.signal(signal.SIGKILL)
        await asyncio.to_thread(self.redis.child.proc.wait, 10)
        await asyncio.sleep(2 * self.ttl_s)
        await asyncio.to_thread(self.redis.restart)
        await self.whole()
        return fault
