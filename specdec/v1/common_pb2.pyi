from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class PackedQ(_message.Message):
    __slots__ = ("sizes", "id_deltas", "id_escapes", "counts", "count_escapes", "tails", "bits", "hidden_codes", "hidden_scales")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    ID_DELTAS_FIELD_NUMBER: _ClassVar[int]
    ID_ESCAPES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_ESCAPES_FIELD_NUMBER: _ClassVar[int]
    TAILS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_CODES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SCALES_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    id_deltas: bytes
    id_escapes: _containers.RepeatedScalarFieldContainer[int]
    counts: bytes
    count_escapes: _containers.RepeatedScalarFieldContainer[int]
    tails: _containers.RepeatedScalarFieldContainer[int]
    bits: int
    hidden_codes: bytes
    hidden_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., id_deltas: _Optional[bytes] = ..., id_escapes: _Optional[_Iterable[int]] = ..., counts: _Optional[bytes] = ..., count_escapes: _Optional[_Iterable[int]] = ..., tails: _Optional[_Iterable[int]] = ..., bits: _Optional[int] = ..., hidden_codes: _Optional[bytes] = ..., hidden_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_fingerprint", "dtype", "device", "architecture", "eos_token_id", "max_context", "server_version", "protocol_version", "eos_token_ids", "model_fingerprint", "head_fingerprint")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    dtype: str
    device: str
    architecture: str
    eos_token_id: int
    max_context: int
    server_version: str
    protocol_version: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_fingerprint: str
    head_fingerprint: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., architecture: _Optional[str] = ..., eos_token_id: _Optional[int] = ..., max_context: _Optional[int] = ..., server_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_fingerprint: _Optional[str] = ..., head_fingerprint: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "tokens", "params", "wire_top_k", "wire_eps", "wire_bits", "wire_hidden")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    WIRE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    WIRE_EPS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BITS_FIELD_NUMBER: _ClassVar[int]
    WIRE_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    wire_top_k: int
    wire_eps: float
    wire_bits: int
    wire_hidden: bool
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., wire_top_k: _Optional[int] = ..., wire_eps: _Optional[float] = ..., wire_bits: _Optional[int] = ..., wire_hidden: _Optional[bool] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("cache_len", "relay_token", "next_logits")
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    RELAY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    relay_token: bytes
    next_logits: bool
    def __init__(self, cache_len: _Optional[int] = ..., relay_token: _Optional[bytes] = ..., next_logits: _Optional[bool] = ...) -> None: ...

class Rollback(_message.Message):
    __slots__ = ("cache_len",)
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    def __init__(self, cache_len: _Optional[int] = ...) -> None: ...

class RolledBack(_message.Message):
    __slots__ = ("cache_len", "removed")
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    removed: int
    def __init__(self, cache_len: _Optional[int] = ..., removed: _Optional[int] = ...) -> None: ...
