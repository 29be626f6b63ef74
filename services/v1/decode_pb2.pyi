from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "first_token_id", "first_logprob", "block_keys", "kvstore_address", "layout", "block_kvstore_addresses", "resume_token_ids", "nixl")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KVSTORE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    kvstore_address: str
    layout: _common_pb2.BlockLayout
    block_kvstore_addresses: _containers.RepeatedScalarFieldContainer[str]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    nixl: _common_pb2.NixlSource
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., kvstore_address: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., block_kvstore_addresses: _Optional[_Iterable[str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., nixl: _Optional[_Union[_common_pb2.NixlSource, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_cached_tokens", "num_transferred_tokens", "spec", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    num_cached_tokens: int
    num_transferred_tokens: int
    spec: SpecDecodeCounts
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_transferred_tokens: _Optional[int] = ..., spec: _Optional[_Union[SpecDecodeCounts, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class SpecDecodeCounts(_message.Message):
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeStatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeStatResponse(_message.Message):
    __slots__ = ("num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "prefix_cache_hits", "prefix_cache_queries", "kv_blocks_imported", "kv_bytes_imported", "kv_blocks_rejected", "kv_fetch_failures")
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    kv_blocks_imported: int
    kv_bytes_imported: int
    kv_blocks_rejected: int
    kv_fetch_failures: int
    def __init__(self, num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., kv_blocks_imported: _Optional[int] = ..., kv_bytes_imported: _Optional[int] = ..., kv_blocks_rejected: _Optional[int] = ..., kv_fetch_failures: _Optional[int] = ...) -> None: ...
