"""Why a request ended: one set of reasons for the engine, the workers and the gateway."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Why a request ended (vLLM's ``FinishReason``).

    A ``str`` enum whose values are the words the protos' ``finish_reason`` fields carry
    (``pdserve.wire.convert`` reads and writes them); OpenAI's two reasons are made from
    it at the REST edge.
    """

    STOP = "stop"  # an EOS token, a stop token id, or (in the gateway) a stop string
    LENGTH = "length"  # max_tokens, or the model's length limit
    ABORT = "abort"  # cancelled before it finished (the caller went away)
    ERROR = "error"  # this request failed; its RequestError says why
    # A prefill worker's request: its first token is sampled and its prompt's blocks are
    # held for export; a decode worker generates the rest. Never sent on the wire.
    PREFILLED = "prefilled"
