from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "cache_len", "pending_tokens", "draft_tokens", "draft_q", "params", "seed", "return_dense_p")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_Q_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_DENSE_P_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_len: int
    pending_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_q: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    params: _common_pb2.SamplingParams
    seed: int
    return_dense_p: bool
    def __init__(self, session_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., pending_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_q: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., return_dense_p: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("p_draft", "residual_tokens", "bonus_token", "cache_len", "dense_p")
    P_DRAFT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    DENSE_P_FIELD_NUMBER: _ClassVar[int]
    p_draft: _containers.RepeatedScalarFieldContainer[float]
    residual_tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    cache_len: int
    dense_p: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    def __init__(self, p_draft: _Optional[_Iterable[float]] = ..., residual_tokens: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., cache_len: _Optional[int] = ..., dense_p: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ...) -> None: ...
