from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "cache_len", "append_tokens", "gamma", "params", "seed", "wire_top_k")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WIRE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    gamma: int
    params: _common_pb2.SamplingParams
    seed: int
    wire_top_k: int
    def __init__(self, session_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ..., gamma: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., wire_top_k: _Optional[int] = ...) -> None: ...

class DraftToken(_message.Message):
    __slots__ = ("index", "token_id", "q", "cache_len")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    q: _common_pb2.Distribution
    cache_len: int
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., q: _Optional[_Union[_common_pb2.Distribution, _Mapping]] = ..., cache_len: _Optional[int] = ...) -> None: ...
