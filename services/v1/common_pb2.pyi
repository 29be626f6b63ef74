from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "logprob_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    structured_outputs: StructuredOutputs
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIdList]
    prompt_logprobs: int
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIdList, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: StringList
    grammar: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StringList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIdList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    class TopEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.ScalarMap[int, float]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Mapping[int, float]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class BlockLayout(_message.Message):
    __slots__ = ("version", "model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_head_start", "total_kv_heads")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_fingerprint: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_head_start: int
    total_kv_heads: int
    def __init__(self, version: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., total_kv_heads: _Optional[int] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("key", "data", "num_tokens", "layout", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    num_tokens: int
    layout: BlockLayout
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., checksum: _Optional[int] = ...) -> None: ...

class NixlSource(_message.Message):
    __slots__ = ("worker_id", "agent_name", "addresses", "checksums", "block_bytes", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    agent_name: str
    addresses: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    lease: str
    def __init__(self, worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., addresses: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., lease: _Optional[str] = ...) -> None: ...
