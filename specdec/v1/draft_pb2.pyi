from specdec.v1 import common_pb2 as _common_pb2
from specdec.v1 import target_pb2 as _target_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("open", "propose", "rollback", "retune")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    RETUNE_FIELD_NUMBER: _ClassVar[int]
    open: _common_pb2.OpenSession
    propose: Propose
    rollback: _common_pb2.Rollback
    retune: Retune
    def __init__(self, open: _Optional[_Union[_common_pb2.OpenSession, _Mapping]] = ..., propose: _Optional[_Union[Propose, _Mapping]] = ..., rollback: _Optional[_Union[_common_pb2.Rollback, _Mapping]] = ..., retune: _Optional[_Union[Retune, _Mapping]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("opened", "proposal", "rolled_back", "retuned")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    RETUNED_FIELD_NUMBER: _ClassVar[int]
    opened: _common_pb2.SessionOpened
    proposal: Proposal
    rolled_back: _common_pb2.RolledBack
    retuned: Retuned
    def __init__(self, opened: _Optional[_Union[_common_pb2.SessionOpened, _Mapping]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., rolled_back: _Optional[_Union[_common_pb2.RolledBack, _Mapping]] = ..., retuned: _Optional[_Union[Retuned, _Mapping]] = ...) -> None: ...

class Retune(_message.Message):
    __slots__ = ("gamma",)
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    gamma: int
    def __init__(self, gamma: _Optional[int] = ...) -> None: ...

class Retuned(_message.Message):
    __slots__ = ("from_block",)
    FROM_BLOCK_FIELD_NUMBER: _ClassVar[int]
    from_block: int
    def __init__(self, from_block: _Optional[int] = ...) -> None: ...

class Propose(_message.Message):
    __slots__ = ("cache_len", "append_tokens", "gamma", "seed", "relay", "guess_residuals", "pipeline")
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    GUESS_RESIDUALS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    gamma: int
    seed: int
    relay: RelayTo
    guess_residuals: bool
    pipeline: Pipeline
    def __init__(self, cache_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ..., gamma: _Optional[int] = ..., seed: _Optional[int] = ..., relay: _Optional[_Union[RelayTo, _Mapping]] = ..., guess_residuals: _Optional[bool] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("key", "tokens", "depth", "stream_seed", "stream_position")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_POSITION_FIELD_NUMBER: _ClassVar[int]
    key: int
    tokens: int
    depth: int
    stream_seed: int
    stream_position: int
    def __init__(self, key: _Optional[int] = ..., tokens: _Optional[int] = ..., depth: _Optional[int] = ..., stream_seed: _Optional[int] = ..., stream_position: _Optional[int] = ...) -> None: ...

class RelayTo(_message.Message):
    __slots__ = ("target", "relay_token", "verify", "draft_on")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RELAY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ON_FIELD_NUMBER: _ClassVar[int]
    target: str
    relay_token: bytes
    verify: _target_pb2.Verify
    draft_on: DraftOn
    def __init__(self, target: _Optional[str] = ..., relay_token: _Optional[bytes] = ..., verify: _Optional[_Union[_target_pb2.Verify, _Mapping]] = ..., draft_on: _Optional[_Union[DraftOn, _Mapping]] = ...) -> None: ...

class DraftOn(_message.Message):
    __slots__ = ("uniforms", "gamma", "seed", "ahead")
    UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    uniforms: _containers.RepeatedScalarFieldContainer[float]
    gamma: int
    seed: int
    ahead: bool
    def __init__(self, uniforms: _Optional[_Iterable[float]] = ..., gamma: _Optional[int] = ..., seed: _Optional[int] = ..., ahead: _Optional[bool] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("tokens", "q", "cache_len", "compute_s", "forward_s", "batch_tokens", "relayed", "relay_bytes", "lead_s", "guess_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    RELAY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEAD_S_FIELD_NUMBER: _ClassVar[int]
    GUESS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _common_pb2.PackedQ
    cache_len: int
    compute_s: float
    forward_s: float
    batch_tokens: float
    relayed: bool
    relay_bytes: int
    lead_s: float
    guess_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[_common_pb2.PackedQ, _Mapping]] = ..., cache_len: _Optional[int] = ..., compute_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., batch_tokens: _Optional[float] = ..., relayed: _Optional[bool] = ..., relay_bytes: _Optional[int] = ..., lead_s: _Optional[float] = ..., guess_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
