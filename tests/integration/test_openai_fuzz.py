"""Fuzz the OpenAI REST API from its own OpenAPI schema (schemathesis) against a real
gateway over a decode worker: no 5xx, every answer in time, every error in OpenAI's shape,
and every status and content type one the schema documents (as vLLM's own schemathesis
test of its server checks).

Run it alone with `make test ARGS="-k fuzz"`.
"""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from tests.helpers.clusters import rest_address, running, start_colocated

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 48  # bounds every generation, whatever max_tokens the fuzzer picks
EXAMPLES_PER_OPERATION = 40
RESPONSE_TIMEOUT_S = 20.0
DOCUMENTED = [status_code_conformance, content_type_conformance]
GATEWAY = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME]


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_chat_llama_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("fuzz-logs")) as c:
        start_colocated(c, tiny_chat_llama_path, gateway=GATEWAY)
        yield c


def _assert_openai_error(response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, response.text
    assert isinstance(error["message"], str) and isinstance(error["type"], str)


def test_fuzz_post_routes_from_the_openapi_schema(fuzz_gateway):
    base = f"http://{rest_address(fuzz_gateway)}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [r.ok() for r in schema.include(method="POST").get_all_operations()]
    assert {op.path for op in operations} == {
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        # Bodies read by hand (no schema: schemathesis sends arbitrary ones).
        "/v1/chat/completions/batch",
        "/invocations",
        "/ping",
    }

    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,  # the same examples every run
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL_NAME  # reach generation, not only the 404
            started = time.monotonic()
            response = case.call(base_url=base, timeout=RESPONSE_TIMEOUT_S)
            assert time.monotonic() - started < RESPONSE_TIMEOUT_S
            assert response.status_code < 500, (case.body, response.text)
            if response.status_code >= 300:
                _assert_openai_error(response)
            case.validate_response(response, checks=DOCUMENTED)

        check()

    for operation in schema.include(method="GET").get_all_operations():
        case = operation.ok().Case()
        case.validate_response(case.call(base_url=base, timeout=10), checks=DOCUMENTED)

    with httpx.Client(base_url=base, timeout=10) as http:
        assert http.get("/health").status_code == 200
    assert fuzz_gateway.unhandled_errors() == []
