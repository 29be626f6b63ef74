"""The REST request models against the fields they must know: every field of OpenAI's and
vLLM's chat and completion requests is served or refused, each refused one a 400 naming it
when it asks for something; docs/openai.md is generated from the same table and names tests
that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.gateway import openai_docs
from pdserve.gateway.openai_errors import APIError
from pdserve.gateway.openai_fields import REFUSED, SERVED
from pdserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}

# A value that asks for something, for each refused field.
ASKING = {
    "use_beam_search": True, "length_penalty": 2.0, "early_stopping": True, "best_of": 3,
    "watermarking": True, "cache_salt": "salt", "priority": 1,
    "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "repetition_detection": {"a": 1}, "stream_interval": 4,
    "spaces_between_special_tokens": False, "return_weight_versions": True,
    "routed_experts_prompt_start": 3, "return_token_offsets": True, "return_prompt_text": True,
    "mm_payload": {"a": 1}, "return_mm_kwargs": True, "mm_processor_kwargs": {"a": 1},
    "media_io_kwargs": {"a": 1}, "session_id": "s", "thinking_token_budget": 10,
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"],
    "guided_grammar": "root ::= x", "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "guided_json_object": True, "store": True,
    "service_tier": "flex", "audio": {"voice": "x"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content"}, "web_search_options": {}, "verbosity": "low",
    "function_call": "auto", "functions": [{"name": "f"}], "chat_template": "{{ x }}",
    "suffix": "end", "prompt_embeds": "AAAA",
}  # fmt: skip
NOT_EMPTY = {"web_search_options": {"search_context_size": "low"}}


def _fields(model: type) -> set[str]:
    return set(model.model_fields)


def test_every_field_is_served_or_refused_and_never_both():
    every = set().union(*map(_fields, MODELS))
    assert every == set(SERVED) | set(REFUSED)
    assert not set(SERVED) & set(REFUSED)
    assert set(ASKING) == set(REFUSED)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refused_field_is_refused_by_name(name):
    body = dict(CHAT if name in ChatCompletionRequest.model_fields else TEXT)
    body[name] = NOT_EMPTY.get(name, ASKING[name])
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as error:
        model.model_validate(body)
    assert error.value.status == 400 and error.value.param == name
    assert name in error.value.message and "not served" in error.value.message
    # At what asks for nothing, it is accepted.
    for allowed in REFUSED[name].allowed:
        model.model_validate({**body, name: allowed})


def test_accepted_fields():
    body = ChatCompletionRequest.model_validate(
        {**CHAT, "safety_identifier": "u1", "prompt_cache_key": "k", "metadata": {"a": "b"}}
    )
    assert body.unknown_fields() == []


def test_unknown_fields_are_listed():
    body = CompletionRequest.model_validate({**TEXT, "temprature": 0.5, "x": 1})
    assert body.unknown_fields() == ["temprature", "x"]


def test_the_named_tests_exist():
    for served in SERVED.values():
        for test in served.tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"def {re.escape(name)}\b", source), test
    path, name = openai_docs.REFUSAL_TEST.split("::")
    assert f"def {name}(" in (ROOT / path).read_text()


def test_openai_md_is_generated_from_the_table():
    committed = (ROOT / "docs" / "openai.md").read_text()
    assert committed == openai_docs.render(), f"run `{openai_docs.REGENERATE}`"
