from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RelayedVerify(_message.Message):
    __slots__ = ("relay_token", "verify", "tag", "echo")
    RELAY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    relay_token: bytes
    verify: Verify
    tag: int
    echo: bool
    def __init__(self, relay_token: _Optional[bytes] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., tag: _Optional[int] = ..., echo: _Optional[bool] = ...) -> None: ...

class RelayAck(_message.Message):
    __slots__ = ("tag", "accepted", "reason", "verdict")
    TAG_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    accepted: bool
    reason: str
    verdict: Verdict
    def __init__(self, tag: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("open", "verify", "rollback")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    open: _common_pb2.OpenSession
    verify: Verify
    rollback: _common_pb2.Rollback
    def __init__(self, open: _Optional[_Union[_common_pb2.OpenSession, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., rollback: _Optional[_Union[_common_pb2.Rollback, _Mapping]] = ...) -> None: ...

class TargetReply(_message.Message):
    __slots__ = ("opened", "verdict", "rolled_back")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    opened: _common_pb2.SessionOpened
    verdict: Verdict
    rolled_back: _common_pb2.RolledBack
    def __init__(self, opened: _Optional[_Union[_common_pb2.SessionOpened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., rolled_back: _Optional[_Union[_common_pb2.RolledBack, _Mapping]] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("cache_len", "pending_tokens", "draft_tokens", "draft_q", "seed", "return_dense_p", "return_pit", "run_tokens", "cancel_relays", "guess_tokens", "chain", "pipeline", "alternates", "draft_idle", "draft_forward_s")
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_Q_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_DENSE_P_FIELD_NUMBER: _ClassVar[int]
    RETURN_PIT_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_RELAYS_FIELD_NUMBER: _ClassVar[int]
    GUESS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    ALTERNATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    pending_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_q: _common_pb2.PackedQ
    seed: int
    return_dense_p: bool
    return_pit: bool
    run_tokens: int
    cancel_relays: _containers.RepeatedScalarFieldContainer[int]
    guess_tokens: _containers.RepeatedScalarFieldContainer[int]
    chain: Chain
    pipeline: int
    alternates: _containers.RepeatedScalarFieldContainer[int]
    draft_idle: bool
    draft_forward_s: float
    def __init__(self, cache_len: _Optional[int] = ..., pending_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_q: _Optional[_Union[_common_pb2.PackedQ, _Mapping]] = ..., seed: _Optional[int] = ..., return_dense_p: _Optional[bool] = ..., return_pit: _Optional[bool] = ..., run_tokens: _Optional[int] = ..., cancel_relays: _Optional[_Iterable[int]] = ..., guess_tokens: _Optional[_Iterable[int]] = ..., chain: _Optional[_Union[Chain, _Mapping]] = ..., pipeline: _Optional[int] = ..., alternates: _Optional[_Iterable[int]] = ..., draft_idle: _Optional[bool] = ..., draft_forward_s: _Optional[float] = ...) -> None: ...

class Chain(_message.Message):
    __slots__ = ("after_seed", "uniforms", "match", "first_token", "after_rejection", "rejected_at", "residual_token")
    AFTER_SEED_FIELD_NUMBER: _ClassVar[int]
    UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    AFTER_REJECTION_FIELD_NUMBER: _ClassVar[int]
    REJECTED_AT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    after_seed: int
    uniforms: _containers.RepeatedScalarFieldContainer[float]
    match: bool
    first_token: int
    after_rejection: bool
    rejected_at: int
    residual_token: int
    def __init__(self, after_seed: _Optional[int] = ..., uniforms: _Optional[_Iterable[float]] = ..., match: _Optional[bool] = ..., first_token: _Optional[int] = ..., after_rejection: _Optional[bool] = ..., rejected_at: _Optional[int] = ..., residual_token: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("p_draft", "q_draft", "residual_tokens", "bonus_token", "cache_len", "dense_p", "compute_s", "mass_above", "p_at", "forward_s", "batch_tokens", "run_tokens", "seed", "draft_tokens", "wide", "draft_forward_s")
    P_DRAFT_FIELD_NUMBER: _ClassVar[int]
    Q_DRAFT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    DENSE_P_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    MASS_ABOVE_FIELD_NUMBER: _ClassVar[int]
    P_AT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WIDE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    p_draft: _containers.RepeatedScalarFieldContainer[float]
    q_draft: _containers.RepeatedScalarFieldContainer[float]
    residual_tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    cache_len: int
    dense_p: _containers.RepeatedScalarFieldContainer[float]
    compute_s: float
    mass_above: _containers.RepeatedScalarFieldContainer[float]
    p_at: _containers.RepeatedScalarFieldContainer[float]
    forward_s: float
    batch_tokens: int
    run_tokens: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    wide: bool
    draft_forward_s: float
    def __init__(self, p_draft: _Optional[_Iterable[float]] = ..., q_draft: _Optional[_Iterable[float]] = ..., residual_tokens: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., cache_len: _Optional[int] = ..., dense_p: _Optional[_Iterable[float]] = ..., compute_s: _Optional[float] = ..., mass_above: _Optional[_Iterable[float]] = ..., p_at: _Optional[_Iterable[float]] = ..., forward_s: _Optional[float] = ..., batch_tokens: _Optional[int] = ..., run_tokens: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., wide: _Optional[bool] = ..., draft_forward_s: _Optional[float] = ...) -> None: ...
