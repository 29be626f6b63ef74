"""The control plane end to end: every service a real process registered in a real
Redis-compatible server; the gateway routes from the registry while pools change.

Each test starts its own cluster under its own key prefix, on a shared Redis server
(except the test that kills Redis)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdserve.controlplane.view import RegistryView
from pdserve.core.fingerprint import model_fingerprint
from pdserve.engine import LLM, SamplingParams
from pdserve.kv.hashing import prompt_block_hashes
from pdserve.local.launcher import free_port
from pdserve.local.redis_server import start_redis
from pdserve.runtime.rpc import aio_channel
from pdserve.testing.cluster import Cluster
from pdserve.testing.metrics import metric, samples, scrape, value
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.helpers.flags import engine_flags

TTL_S = 2.0
ENGINE = engine_flags(registry_ttl=TTL_S)
MAX_NEW = 8
WAIT_S = 30.0


def start_all(cluster: Cluster, specs: list[tuple]) -> list:
    """Start services in parallel (their models load at the same time)."""
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(lambda spec: cluster.start(*spec), specs))


def worker_specs(tiny_llama_path, url, prefix, prefill=1, decode=1, kvstore=True, grpc=False):
    """``grpc``: KV through the kvstores only (else NIXL where it is installed)."""
    reg = ["--redis-url", url, "--redis-prefix", prefix]
    model = ["--model", str(tiny_llama_path)] + (["--kv-transport", "grpc"] if grpc else [])
    specs = []
    if kvstore:
        kv = ("kvstore", "pdserve.kvstore", "--capacity-bytes", "64MiB", *reg)
        specs.append((*kv, "--registry-ttl", str(TTL_S)))
    specs += [(f"prefill-{i}", "pdserve.prefill", *reg, *model, *ENGINE) for i in range(prefill)]
    specs += [(f"decode-{i}", "pdserve.decode", *reg, *model, *ENGINE) for i in range(decode)]
    return specs


def start_gateway(cluster, name, tiny_llama_path, url, prefix, *args):
    gw = cluster.start(
        name,
        "pdserve.gateway",
        "--redis-url",
        url,
        "--redis-prefix",
        prefix,
        "--model",
        str(tiny_llama_path),
        *args,
    )
    gw.http_address = gw.addresses["gateway-http"]
    return gw


def request(prompt, rid, max_tokens=MAX_NEW):
    return gateway_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=gateway_pb2.TokenIds(ids=prompt),
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


async def generate(address, prompt, rid):
    async with aio_channel(address) as ch:
        out = await gateway_pb2_grpc.GatewayStub(ch).Generate(request(prompt, rid), timeout=60)
        return list(out.token_ids)


def gateway_metric(gateway, name: str, **labels: str) -> float:
    """The gateway's samples called ``name`` with these labels, summed."""
    return metric(f"http://{gateway.http_address}", name, **labels)


def pool_size(gateway, pool: str) -> int:
    return int(gateway_metric(gateway, "pdserve:pool_workers", pool=pool))


async def until(predicate, timeout: float = WAIT_S, what: str = "condition") -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await predicate():
        if loop.time() - start > timeout:
            raise AssertionError(f"{what} not met within {timeout} s")
        await asyncio.sleep(0.05)
    return loop.time() - start


class Flow:
    """Requests sent without pause by ``n`` clients until stopped; every result kept."""

    def __init__(self, address: str, prompts: list[list[int]], n: int = 3) -> None:
        self.address, self.prompts = address, prompts
        self.outputs: dict[int, set[tuple[int, ...]]] = {}
        self.failures: list[str] = []
        self.count = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(n)]

    async def _client(self, c: int) -> None:
        k = c
        while not self._stop.is_set():
            i = k % len(self.prompts)
            try:
                out = await generate(self.address, self.prompts[i], f"flow-{c}-{k}")
                self.outputs.setdefault(i, set()).add(tuple(out))
                self.count += 1
            except Exception as e:  # noqa: BLE001 (every failure is the test's business)
                self.failures.append(f"{type(e).__name__}: {e}")
            k += 3

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), WAIT_S)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


async def test_decode_pool_scales_out_and_in_while_requests_flow(
    tiny_llama_path, shared_redis_server, cluster
):
    url, prefix = shared_redis_server.url, "scale"
    started = start_all(cluster, worker_specs(tiny_llama_path, url, prefix, decode=1))
    gw = start_gateway(cluster, "gateway", tiny_llama_path, url, prefix)
    view = RegistryView(url, prefix=prefix, refresh_s=0.1)
    await view.start()
    loop = asyncio.get_running_loop()

    def entry(address):
        return next((w for w in view.workers("decode") if w.address == address), None)

    flow = Flow(gw.address, prompts(1, 6, 40))
    try:
        await until(lambda: asyncio.sleep(0, flow.count >= 6), what="first requests")
        # Scale out: two more decode workers join while requests flow.
        joined = await asyncio.to_thread(
            start_all,
            cluster,
            [spec for spec in worker_specs(tiny_llama_path, url, prefix, 0, 3, False)][1:],
        )
        ready_at = loop.time()
        for svc in joined:

            async def served(svc=svc):
                e = entry(svc.address)
                return e is not None and e.requests_total > 0

            await until(served, what=f"{svc.name} receiving requests")
            # The registry reports requests a heartbeat late: 0.2 s at most.
            assert loop.time() - ready_at < 5.0 + 0.2, f"{svc.name} got no request in 5 s"

        # Scale in gracefully: the gateway drops the worker at once; nothing fails.
        first = started[-1]
        assert pool_size(gw, "decode") == 3
        t0 = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)
        while pool_size(gw, "decode") != 2:
            assert time.monotonic() - t0 < 1.0, "the gateway still routes to a stopped worker"
            await asyncio.sleep(0.02)
        assert await asyncio.to_thread(first.proc.wait, 30) == 0
        count = flow.count
        await until(lambda: asyncio.sleep(0, flow.count >= count + 6), what="more requests")
        await flow.stop()
        assert flow.failures == []
        assert all(len(outs) == 1 for outs in flow.outputs.values()), "outputs differ by worker"

        # A SIGKILLed idle worker leaves the gateway's pool within the TTL.
        killed = joined[-1]
        t0 = time.monotonic()
        killed.proc.kill()
        while pool_size(gw, "decode") != 1:
            assert time.monotonic() - t0 < TTL_S + 0.3, "a dead worker outlived its TTL"
            await asyncio.sleep(0.05)
        outs = await asyncio.gather(
            *(generate(gw.address, p, f"after-{i}") for i, p in enumerate(prompts(1, 6, 40)))
        )
        assert [{tuple(o)} for o in outs] == [flow.outputs[i] for i in range(6)]
    finally:
        await view.close()
    assert [e for e in cluster.unhandled_errors() if not e.startswith(killed.name)] == []


async def decode_stats(addresses):
    out = []
    for address in addresses:
        async with aio_channel(address) as ch:
            out.append(
                await decode_pb2_grpc.DecodeStub(ch).Stat(
                    decode_pb2.DecodeStatRequest(), timeout=10
                )
            )
    return out


def families(seed: int, n_families=8, per_family=4, prefix_len=128, suffix_len=8):
    """Prompts of ``n_families`` long shared prefixes, shuffled (seeded)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(prefix_len)] for _ in range(n_families)]
    out = [
        head + [rng.randrange(3, 500) for _ in range(suffix_len)]
        for head in heads
        for _ in range(per_family)
    ]
    rng.shuffle(out)
    return out


async def test_prefix_aware_routing_hits_the_cache_more_than_round_robin(
    tiny_llama_path, shared_redis_server, cluster
):
    url, prefix = shared_redis_server.url, "route"
    decoders = start_all(
        cluster, worker_specs(tiny_llama_path, url, prefix, prefill=0, decode=2, kvstore=False)
    )
    common = ("--disaggregation", "off")
    gws = {
        mode: start_gateway(
            cluster, f"gw-{mode}", tiny_llama_path, url, prefix, *common, "--routing", mode
        )
        for mode in ("round-robin", "prefix")
    }
    addresses = [d.address for d in decoders]
    rates, shares = {}, {}
    for seed, (mode, gw) in enumerate(gws.items()):
        await until(lambda gw=gw: asyncio.sleep(0, pool_size(gw, "decode") == 2), what="pool")
        before = await decode_stats(addresses)
        work = families(seed)
        sem = asyncio.Semaphore(2)

        async def one(i, p, gw=gw, mode=mode, sem=sem):
            async with sem:
                return await generate(gw.address, p, f"{mode}-{i}")

        await asyncio.gather(*(one(i, p) for i, p in enumerate(work)))
        after = await decode_stats(addresses)
        hits = sum(
            a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before, strict=True)
        )
        queries = sum(
            a.prefix_cache_queries - b.prefix_cache_queries
            for a, b in zip(after, before, strict=True)
        )
        rates[mode] = hits / queries
        routed = [
            s.value
            for s in samples(scrape(f"http://{gw.http_address}"))
            if s.name == "pdserve:routed_requests_total"
        ]
        shares[mode] = max(routed) / sum(routed)
        assert sum(routed) == len(work)
    print(f"prefix-cache hit rate: {rates}; largest share of requests: {shares}")
    assert rates["prefix"] > rates["round-robin"]
    assert shares["prefix"] <= 0.70
    # The routing also stands on the registry's block sets (not only on what a gateway
    # remembers sending): every family's 8 prefix blocks are listed for some worker.
    fingerprint = model_fingerprint(tiny_llama_path)
    view = RegistryView(url, prefix=prefix)
    await view.start()
    try:
        for head in {tuple(p[:128]) for p in families(1)}:
            hashes = prompt_block_hashes(list(head), 16, fingerprint)

            async def listed(hashes=hashes):
                held = await view.prefix_lengths(view.workers("decode"), lambda bs: hashes)
                return max(held.values(), default=0) == 8

            await until(listed, timeout=5, what="the family's blocks in a registry block set")
    finally:
        await view.close()


async def test_short_prompts_skip_the_prefill_pool_with_identical_output(
    tiny_llama_path, shared_redis_server, cluster
):
    url, prefix = shared_redis_server.url, "cond"
    start_all(cluster, worker_specs(tiny_llama_path, url, prefix))
    always = start_gateway(cluster, "gw-always", tiny_llama_path, url, prefix)
    cond = start_gateway(
        cluster, "gw-cond", tiny_llama_path, url, prefix, "--local-prefill-threshold", "48"
    )
    view = RegistryView(url, prefix=prefix)
    await view.start()
    try:
        short = prompts(3, 4, 20) + prompts(4, 2, 47)
        long = prompts(5, 2, 100)
        llm = LLM(
            model=str(tiny_llama_path), dtype="float32", num_kv_blocks=128, enforce_eager=True
        )
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        expected = [o.token_ids for o in llm.generate(short + long, params)]

        def prefill_requests() -> int:
            return view.workers("prefill")[0].requests_total

        await until(lambda: asyncio.sleep(0, len(view.workers("prefill")) == 1), what="view")
        served_before = prefill_requests()
        outs = [await generate(cond.address, p, f"c{i}") for i, p in enumerate(short)]
        assert outs == expected[: len(short)]
        await asyncio.sleep(0.5)  # two heartbeats
        assert prefill_requests() == served_before  # no prompt reached the prefill pool
        m = scrape(f"http://{cond.http_address}")
        assert value(m, "pdserve:prefill_requests_total", where="local") == len(short)
        assert value(m, "pdserve:prefill_requests_total", where="remote") == 0

        outs = [await generate(cond.address, p, f"l{i}") for i, p in enumerate(long)]
        assert outs == expected[len(short) :]
        assert gateway_metric(cond, "pdserve:prefill_requests_total", where="remote") == len(long)
        # The same prompts fully disaggregated: the same tokens.
        outs = [await generate(always.address, p, f"a{i}") for i, p in enumerate(short + long)]
        assert outs == expected
        assert gateway_metric(always, "pdserve:prefill_requests_total", where="local") == 0
    finally:
        await view.close()


async def test_losing_redis_fails_no_request_and_the_registry_recovers(tiny_llama_path, cluster):
    redis = start_redis()
    url, prefix = redis.url, "loss"
    try:
        start_all(cluster, worker_specs(tiny_llama_path, url, prefix))
        gw = start_gateway(cluster, "gateway", tiny_llama_path, url, prefix)
        work = prompts(6, 4, 40)
        first = await asyncio.gather(
            *(generate(gw.address, p, f"a{i}") for i, p in enumerate(work))
        )

        redis.child.signal(signal.SIGKILL)
        redis.child.proc.wait(5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * TTL_S:  # well past every TTL
            outs = await asyncio.gather(
                *(generate(gw.address, p, f"b{i}") for i, p in enumerate(work))
            )
            assert outs == first
        assert pool_size(gw, "decode") == 1 and pool_size(gw, "prefill") == 1

        redis.restart()
        view = RegistryView(url, prefix=prefix)
        await view.start()
        try:
            roles = lambda: sorted(w.role for w in view.workers())  # noqa: E731
            await until(
                lambda: asyncio.sleep(0, roles() == ["decode", "kvstore", "prefill"]),
                timeout=10,
                what="every worker registered again",
            )
            outs = await asyncio.gather(
                *(generate(gw.address, p, f"c{i}") for i, p in enumerate(work))
            )
            assert outs == first
            # The prefix index is rebuilt too: the decode worker's block set is back.
            decode = view.workers("decode")[0]

            async def blocks_back():
                held = await view.prefix_lengths([decode], lambda bs: [b"x" * 16])
                n = await view._redis.scard(view.keys.blocks(decode.worker_id))
                return held == {decode.worker_id: 0} and n > 0

            await until(blocks_back, timeout=10, what="the block set rebuilt")
        finally:
            await view.close()
    finally:
        cluster.stop_all()
        redis.stop()
    assert cluster.unhandled_errors() == []


async def test_blocks_split_over_kvstore_replicas_by_rendezvous_hashing(
    tiny_llama_path, shared_redis_server, cluster
):
    from pdserve.kv.client import KVStoreClient

    url, prefix = shared_redis_server.url, "replicas"
    reg = ["--redis-url", url, "--redis-prefix", prefix, "--registry-ttl", str(TTL_S)]
    kv_specs = [
        (f"kvstore-{i}", "pdserve.kvstore", "--capacity-bytes", "64MiB", *reg) for i in range(2)
    ]
    kvs = start_all(cluster, kv_specs)
    view = RegistryView(url, prefix=prefix)
    await view.start()
    try:
        await until(lambda: asyncio.sleep(0, len(view.workers("kvstore")) == 2), what="kvstores")
        # Over gRPC: the decode worker then fetches every block from its replica.
        start_all(cluster, worker_specs(tiny_llama_path, url, prefix, kvstore=False, grpc=True))
        gw = start_gateway(cluster, "gateway", tiny_llama_path, url, prefix)
        work = prompts(7, 6, 100)  # 6 full blocks and a tail each: 42 keys
        llm = LLM(
            model=str(tiny_llama_path), dtype="float32", num_kv_blocks=128, enforce_eager=True
        )
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        expected = [o.token_ids for o in llm.generate(work, params)]
        outs = await asyncio.gather(*(generate(gw.address, p, f"r{i}") for i, p in enumerate(work)))
        assert outs == expected
        stats = []
        for kv in kvs:
            async with KVStoreClient(kv.address) as client:
                stats.append(await client.stat(timeout=10))
        # Each replica holds its share, and the decode worker fetched from both.
        assert all(s.blocks_in > 0 and s.blocks_out > 0 for s in stats), stats
        assert sum(s.blocks_in for s in stats) == len(work) * 7
    finally:
        await view.close()
    assert cluster.unhandled_errors() == []


async def test_a_cluster_on_ipv6_addresses_serves_and_registers_dialable_addresses(
    tiny_llama_path, shared_redis_server, cluster
):
    """As on an IPv6 Kubernetes cluster: every server binds an IPv6 address (the loopback
    here) and each worker advertises ``$(POD_IP):PORT`` as the chart writes it, the IPv6
    address unbracketed. The registry holds addresses a gRPC client can dial, metrics are
    scraped at theirs, and a request goes through every pool."""
    url, prefix = shared_redis_server.url, "ipv6"
    specs = []
    for name, module, *args in worker_specs(tiny_llama_path, url, prefix):
        port = free_port("::1")
        specs.append((name, module, *args, "--host", "::1", "--port", str(port),
                      "--advertise-address", f"::1:{port}", "--metrics-port", "0"))  # fmt: skip
    start_all(cluster, specs)
    gw = start_gateway(cluster, "gateway", tiny_llama_path, url, prefix, "--host", "::1")
    prompt = prompts(7, 1, 40)[0]
    view = RegistryView(url, prefix=prefix, refresh_s=0.1)
    await view.start()
    try:
        await until(lambda: asyncio.sleep(0, len(view.workers()) == 3), what="registrations")
        for w in view.workers():
            assert w.address.startswith("[::1]:"), w
            assert w.metrics_address.startswith("[::1]:"), w
            assert "pdserve:" in httpx.get(f"http://{w.metrics_address}/metrics", timeout=10).text
        assert gw.address.startswith("[::1]:") and gw.http_address.startswith("[::1]:")
        want = (
            LLM(str(tiny_llama_path), dtype="float32")
            .generate(
                [prompt],
                SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
            )[0]
            .token_ids
        )
        assert await generate(gw.address, prompt, "v6") == list(want)
        base = f"http://{gw.http_address}/v1"
        model = httpx.get(f"{base}/models", timeout=10).json()["data"][0]["id"]
        completion = httpx.post(
            f"{base}/completions",
            json={"model": model, "prompt": prompt, "max_tokens": MAX_NEW,
                  "temperature": 0, "ignore_eos": True},
            timeout=60,
        )  # fmt: skip
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"]
    finally:
        await view.close()
