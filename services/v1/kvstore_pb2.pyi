from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutBlocksRequest(_message.Message):
    __slots__ = ("layout", "blocks")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.Block]
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[_common_pb2.Block, _Mapping]]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("num_stored", "bytes_stored")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    bytes_stored: int
    def __init__(self, num_stored: _Optional[int] = ..., bytes_stored: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("layout", "keys", "single_use")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_USE_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    single_use: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., single_use: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("blocks", "missing")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.Block]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, blocks: _Optional[_Iterable[_Union[_common_pb2.Block, _Mapping]]] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("num_blocks", "bytes_used", "capacity_bytes", "bytes_in", "bytes_out", "blocks_in", "blocks_out", "hits", "misses", "evictions", "expired", "dropped", "num_leased", "disk_blocks", "disk_bytes_used", "disk_capacity_bytes", "disk_hits", "disk_writes", "disk_writes_dropped", "disk_damaged", "disk_evictions")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_OUT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DISK_DAMAGED_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    bytes_in: int
    bytes_out: int
    blocks_in: int
    blocks_out: int
    hits: int
    misses: int
    evictions: int
    expired: int
    dropped: int
    num_leased: int
    disk_blocks: int
    disk_bytes_used: int
    disk_capacity_bytes: int
    disk_hits: int
    disk_writes: int
    disk_writes_dropped: int
    disk_damaged: int
    disk_evictions: int
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., blocks_in: _Optional[int] = ..., blocks_out: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., expired: _Optional[int] = ..., dropped: _Optional[int] = ..., num_leased: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_bytes_used: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_writes: _Optional[int] = ..., disk_writes_dropped: _Optional[int] = ..., disk_damaged: _Optional[int] = ..., disk_evictions: _Optional[int] = ...) -> None: ...
