"""Finish reasons: one enum in every process, the same words on the wire and to OpenAI."""

from __future__ import annotations

import pytest

from pdserve.core.finish_reason import FinishReason
from pdserve.gateway.openai_reply import finish_reason as openai_finish_reason
from pdserve.v1 import decode_pb2
from pdserve.wire.convert import finish_reason_from_proto, finish_reason_to_proto


def test_the_words_on_the_wire_are_unchanged():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error", "prefilled"]


@pytest.mark.parametrize(
    "reason", [FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR]
)
def test_a_reason_crosses_the_wire_as_itself(reason):
    message = decode_pb2.DecodeResponse(finish_reason=finish_reason_to_proto(reason))
    wire = decode_pb2.DecodeResponse.FromString(message.SerializeToString())
    assert wire.finish_reason == reason.value
    assert finish_reason_from_proto(wire.finish_reason) is reason


def test_no_reason_and_prefilled_are_empty_on_the_wire():
    """A prefilled request goes on in a decode worker: its prefill answer has no reason."""
    assert finish_reason_to_proto(None) == ""
    assert finish_reason_to_proto(FinishReason.PREFILLED) == ""
    assert finish_reason_from_proto("") is None


def test_a_word_no_worker_sends_is_refused():
    with pytest.raises(ValueError, match="'done'"):
        finish_reason_from_proto("done")


@pytest.mark.parametrize(
    ("reason", "openai"),
    [("length", "length"), ("stop", "stop"), ("abort", "stop"), ("error", "stop")],
)
def test_openai_sees_its_two_reasons(reason, openai):
    assert openai_finish_reason(reason) == openai
