"""One trace per request across gateway, prefill, kvstore and decode, each its own process,
exported over OTLP/gRPC to a receiver this test runs: parent links, gen_ai attributes, the
gateway's TTFT against the client's, and a caller's own traceparent (REST and gRPC)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import httpx
import pytest

from pdserve.runtime.rpc import aio_channel
from pdserve.testing.otlp_collector import OtlpCollector
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.clusters import rest_address, running, start_disaggregated
from tests.helpers.flags import engine_flags

# SmolLM2 in fp32: a prompt of a few hundred tokens takes long enough to prefill that the
# client's and the gateway's TTFT differ by network and parsing only, a few percent.
ENGINE = engine_flags(num_kv_blocks=512, max_model_len=1024)
PROMPT = " ".join(f"Item {i}: the colour of the sky on day {i} was blue." for i in range(30))
SPAN_WAIT_S = 30
SERVICES = {"pdserve-gateway", "pdserve-prefill", "pdserve-kvstore", "pdserve-decode"}
# span name -> its parent's name, within one request's trace
PARENTS = {
    "gateway.tokenize": "llm_request",
    "gateway.admission": "llm_request",
    "gateway.route": "llm_request",
    "gateway.prefill": "llm_request",
    "gateway.decode": "llm_request",
    "prefill.request": "gateway.prefill",
    "prefill.queue": "prefill.request",
    "prefill.prefill_chunk": "prefill.request",
    "prefill.kv_push": "prefill.request",
    "kvstore.put": "prefill.kv_push",
    "decode.request": "gateway.decode",
    "decode.kv_fetch": "decode.request",
    "kvstore.get": "decode.kv_fetch",
    "decode.kv_import": "decode.request",
    "decode.queue": "decode.request",
    "decode.generate": "decode.request",
}


@pytest.fixture(scope="module")
def collector():
    c = OtlpCollector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster(smollm2_path, collector, tmp_path_factory):
    traced = ["--otlp-traces-endpoint", collector.endpoint]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 100 ms, not every 5 s
    with running(tmp_path_factory.mktemp("tracing-logs")) as c:
        start_disaggregated(
            c,
            smollm2_path,
            engine=ENGINE,
            capacity="256MiB",
            internal=traced,
            gateway=traced,
            env=env,
        )
        yield c


def _chat(http: httpx.Client, model: str, content: str, headers=None) -> tuple[dict, float, str]:
    """A streamed chat: its usage, the client's TTFT (seconds to the first SSE event) and
    the gateway's request id (from the completion id)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    usage, ttft, completion_id = None, None, ""
    began = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - began
            event = json.loads(line[len("data: ") :])
            completion_id = event["id"]
            usage = event.get("usage") or usage
    return usage, ttft, completion_id.removeprefix("chatcmpl-")


def _trace(spans, trace_id):
    return [s for s in spans if s.trace_id == trace_id]


# One span of each service: the request's trace has reached all four.
EACH_SERVICE = {"llm_request", "prefill.request", "kvstore.put", "decode.request"}


def _complete(trace_id, names=EACH_SERVICE):
    """Whether the spans ``names`` of ``trace_id`` have arrived."""

    def done(spans):
        return {s.name for s in spans if s.trace_id == trace_id} >= set(names)

    return done


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://{rest_address(cluster)}", timeout=120) as h:
        yield h


def _model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def test_a_streamed_chat_is_one_trace_across_the_four_services(cluster, http, collector):
    model = _model(http)
    _chat(http, model, "Warm up: say hello.")  # first-call costs, and a pooled connection
    usage, client_ttft, request_id = _chat(http, model, PROMPT)

    def root_arrived(spans):
        return any(
            s.name == "llm_request" and s.attributes.get("gen_ai.request.id") == request_id
            for s in spans
        )

    spans = collector.wait_for(root_arrived, SPAN_WAIT_S, "llm_request span")
    root = next(
        s
        for s in spans
        if s.name == "llm_request" and s.attributes["gen_ai.request.id"] == request_id
    )
    every = {"llm_request", *PARENTS}
    spans = collector.wait_for(_complete(root.trace_id, every), SPAN_WAIT_S, "the whole trace")
    trace = _trace(spans, root.trace_id)
    assert {s.service for s in trace} == SERVICES
    assert root.parent_id == "" and root.service == "pdserve-gateway"

    by_id = {s.span_id: s for s in trace}
    for span in trace:
        if span.name in PARENTS:
            assert span.parent_id in by_id, f"{span.name}'s parent is not in the trace"
            assert by_id[span.parent_id].name == PARENTS[span.name], span.name
    one = {s.name: s for s in trace}
    # gen_ai attributes, as vLLM names them
    a = root.attributes
    assert a["gen_ai.response.model"] == model
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 12
    assert a["gen_ai.latency.time_in_queue"] >= 0
    assert 0 < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]
    # The gateway's TTFT is the client's, less the network and HTTP parsing.
    gateway_ttft = a["gen_ai.latency.time_to_first_token"]
    assert abs(gateway_ttft - client_ttft) <= 0.1 * client_ttft, (gateway_ttft, client_ttft)
    print(f"TTFT: gateway {gateway_ttft * 1e3:.1f} ms, client {client_ttft * 1e3:.1f} ms")

    p = one["prefill.request"].attributes
    assert p["gen_ai.request.id"] == request_id + "-0"
    assert p["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert p["gen_ai.usage.completion_tokens"] == 1
    assert p["pdserve.transferred_blocks"] == -(-usage["prompt_tokens"] // 16)
    assert 0 < p["gen_ai.latency.time_to_first_token"] < gateway_ttft
    push = one["prefill.kv_push"].attributes
    assert (
        push["pdserve.transferred_bytes"] == one["kvstore.put"].attributes["pdserve.kvstore.bytes"]
    )

    d = one["decode.request"].attributes
    assert d["gen_ai.usage.completion_tokens"] == 11  # the first came from the prefill
    assert (
        d["pdserve.transferred_blocks"] == one["kvstore.get"].attributes["pdserve.kvstore.blocks"]
    )
    assert d["pdserve.transferred_blocks"] > 0
    assert d["pdserve.worker.id"].startswith("decode-")
    # Without a registry the gateway knows its workers by address only.
    assert one["gateway.decode"].attributes["pdserve.worker.address"] == cluster.address("decode")
    assert one["gateway.prefill"].attributes["pdserve.worker.address"] == cluster.address("prefill")
    chunks = [s for s in trace if s.name == "prefill.prefill_chunk"]
    computed = usage["prompt_tokens"] - p["pdserve.cached_tokens"]  # the rest hit the cache
    assert sum(s.attributes["pdserve.tokens"] for s in chunks) == computed
    assert "first_token" in one["prefill.request"].events


def test_a_callers_traceparent_is_continued_over_rest_and_grpc(cluster, http, collector):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    _chat(http, _model(http), "Which trace is this?", headers=headers)
    spans = collector.wait_for(_complete(trace_id), SPAN_WAIT_S, "the caller's trace")
    root = next(s for s in _trace(spans, trace_id) if s.name == "llm_request")
    assert root.parent_id == parent_id
    assert {s.service for s in _trace(spans, trace_id)} == SERVICES

    grpc_trace, grpc_parent = secrets.token_hex(16), secrets.token_hex(8)
    request = gateway_pb2.GenerateRequest(
        prompt="Over gRPC, " + PROMPT[:200],
        params=common_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    )

    async def stream():
        async with aio_channel(cluster.address("gateway")) as channel:
            metadata = (("traceparent", f"00-{grpc_trace}-{grpc_parent}-01"),)
            call = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(
                request, timeout=120, metadata=metadata
            )
            return [r async for r in call]

    assert sum(len(r.token_ids) for r in asyncio.run(stream())) == 4
    spans = collector.wait_for(_complete(grpc_trace), SPAN_WAIT_S, "the gRPC caller's trace")
    root = next(s for s in _trace(spans, grpc_trace) if s.name == "llm_request")
    assert root.parent_id == grpc_parent
    assert root.attributes["pdserve.operation"] == "GenerateStream"


def test_an_unsampled_traceparent_is_not_traced(http, collector):
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"}
    _, _, request_id = _chat(http, _model(http), "Not sampled.", headers=headers)
    # A later traced request's spans arrive after this one's would have.
    marker = secrets.token_hex(16)
    _chat(http, _model(http), "After.", headers={"traceparent": f"00-{marker}-{'1' * 16}-01"})
    spans = collector.wait_for(_complete(marker), SPAN_WAIT_S, "the marker trace")
    assert _trace(spans, trace_id) == []
    assert not any(s.attributes.get("gen_ai.request.id") == request_id for s in spans)


def test_no_service_logged_an_unhandled_error(cluster):
    assert cluster.unhandled_errors() == []
