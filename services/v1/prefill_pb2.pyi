from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "decode_reads_nixl")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_READS_NIXL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    decode_reads_nixl: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_reads_nixl: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "block_keys", "num_prompt_tokens", "num_cached_tokens", "kvstore_address", "layout", "finish_reason", "block_kvstore_addresses", "prompt_logprobs", "nixl")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KVSTORE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    num_cached_tokens: int
    kvstore_address: str
    layout: _common_pb2.BlockLayout
    finish_reason: str
    block_kvstore_addresses: _containers.RepeatedScalarFieldContainer[str]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    nixl: _common_pb2.NixlSource
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., kvstore_address: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., finish_reason: _Optional[str] = ..., block_kvstore_addresses: _Optional[_Iterable[str]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., nixl: _Optional[_Union[_common_pb2.NixlSource, _Mapping]] = ...) -> None: ...
