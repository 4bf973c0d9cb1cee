from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "gamma", "stop", "seed", "dense", "overlap")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    gamma: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    dense: bool
    overlap: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., gamma: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., dense: _Optional[bool] = ..., overlap: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "stats")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    stats: GenerationStats
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "time_to_first_token_s", "tokens_per_second", "total_time_s", "finish_reason", "gamma", "wire_bytes_per_token", "round_trips", "fallback_steps", "adaptive", "mean_gamma", "overlapped_steps", "judged_tokens", "steps_s", "draft_forward_s", "target_forward_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIPS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    MEAN_GAMMA_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    JUDGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    steps: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    time_to_first_token_s: float
    tokens_per_second: float
    total_time_s: float
    finish_reason: str
    gamma: int
    wire_bytes_per_token: float
    round_trips: int
    fallback_steps: int
    adaptive: bool
    mean_gamma: float
    overlapped_steps: int
    judged_tokens: int
    steps_s: float
    draft_forward_s: float
    target_forward_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., total_time_s: _Optional[float] = ..., finish_reason: _Optional[str] = ..., gamma: _Optional[int] = ..., wire_bytes_per_token: _Optional[float] = ..., round_trips: _Optional[int] = ..., fallback_steps: _Optional[int] = ..., adaptive: _Optional[bool] = ..., mean_gamma: _Optional[float] = ..., overlapped_steps: _Optional[int] = ..., judged_tokens: _Optional[int] = ..., steps_s: _Optional[float] = ..., draft_forward_s: _Optional[float] = ..., target_forward_s: _Optional[float] = ...) -> None: ...

class OrchestratorInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OrchestratorInfo(_message.Message):
    __slots__ = ("draft_model_id", "target_model_id", "vocab_size", "default_gamma", "max_gamma", "max_new_tokens", "max_prompt_tokens", "server_version")
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    draft_model_id: str
    target_model_id: str
    vocab_size: int
    default_gamma: int
    max_gamma: int
    max_new_tokens: int
    max_prompt_tokens: int
    server_version: str
    def __init__(self, draft_model_id: _Optional[str] = ..., target_model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., default_gamma: _Optional[int] = ..., max_gamma: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., server_version: _Optional[str] = ...) -> None: ...
