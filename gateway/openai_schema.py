"""OpenAI's request and response shapes, mapped onto the orchestrator's gRPC API.

Pure functions and small classes, no I/O: ``parse_json`` and
``CompletionShape.parse`` / ``ChatShape.parse`` validate a request body (JSON,
types, ranges) and turn it into a ``GenerateRequest``; the same shape then
renders the orchestrator's chunks and statistics as OpenAI's response objects
and server-sent events.

What maps onto what:

====================================  =========================================
OpenAI field                          GenerateRequest field
====================================  =========================================
``prompt`` (text, or token ids)       ``text`` / ``token_ids``
``messages``                          ``messages`` (the model's chat template),
                                      or ``text`` (``plain_text_chat``), as
                                      ``gateway.chat_template`` says
``max_tokens``                        ``max_new_tokens``
(chat: ``max_completion_tokens``)
``temperature``, ``top_p``, ``stop``,  the same names
``seed``
``top_k``, ``gamma``, ``overlap``      the same names
(extensions)
``n``                                 must be 1
====================================  =========================================

Fields that would change the output distribution or the response format and
that specdec does not implement (``logprobs``, ``tools``, ``logit_bias``,
penalties, ``echo``, ``best_of`` > 1, ``suffix``, a non-text
``response_format``, ...) are refused with a 400 naming the field; their
harmless values (``null``, ``false``, ``0``, ``[]``) are accepted. Fields that
change nothing here (``user``, ``metadata``, ``store``, ...) and unknown fields
are ignored, as OpenAI does.

Not for: HTTP (``app``), the mapping of gRPC statuses (``errors``).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from specdec.config import GatewayConfig
from specdec.v1 import orchestrator_pb2

from .errors import ApiError, invalid, unsupported

# OpenAI's documented default for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_SEED = 2**64 - 1
# OpenAI's seed is a signed 64-bit integer; a negative one is taken as its
# two's complement (the same unsigned 64 bits), so it stays deterministic.
MIN_SEED = -(2**63)
DONE = b"data: [DONE]\n\n"
# Response header saying how a chat was turned into a prompt.
CHAT_TEMPLATE_HEADER = "x-specdec-chat-template"
CHAT_ROLES = ("system", "developer", "user", "assistant")


# ---- JSON and field validation ----------------------------------------------------
def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


INT32_MAX = 2**31 - 1  # the orchestrator's integer fields and token ids are int32


def _not_text(v: str) -> bool:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unpaired_surrogate(body: dict) -> str | None:
    """The path of the first string in ``body`` that holds an unpaired UTF-16 surrogate
    ("" for a key of the body itself; None if there is none): JSON's ``\\ud800``
    escapes allow one, but it is not text, and no protobuf string can carry it.
    (A loop, not recursion: the body may nest as deep as the JSON parser allows.)"""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if _not_text(v):
                return path
        elif isinstance(v, dict):
            for key, item in v.items():
                if _not_text(key):  # a key: name the object it is in
                    return path
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 (NaN and Infinity are not JSON)."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        message = f"the request body is not valid JSON: {e}"
        raise invalid(None, message, code="invalid_json") from None
    except RecursionError:
        raise invalid(None, "the request body nests too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    bad = _unpaired_surrogate(body)
    if bad is not None:
        message = "holds an unpaired UTF-16 surrogate (an escape like \\ud800): not text"
        raise invalid(bad or None, message if bad else f"a key {message}")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def _int(body: Mapping, name: str, default: int | None, lo: int, hi: int = INT32_MAX) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < lo or v > hi:
        raise invalid(name, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _number(body: Mapping, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or v > hi or v < lo or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise invalid(name, f"must be a number in {interval}, got {v!r}")
    return float(v)


def _bool(body: Mapping, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"must be true or false, got {v!r}")
    return v


def _refuse_unless(body: Mapping, name: str, harmless: Iterable[Any], why: str) -> None:
    """400 naming ``name`` if the field is set to anything but a harmless value."""
    if (
        name in body
        and body[name] is not None
        and not any(body[name] == h and type(body[name]) is type(h) for h in harmless)
    ):
        raise unsupported(name, why)


def _stop(body: Mapping) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise invalid("stop", f"must be a string or a list of strings, got {v!r}")


def _stream_options(body: Mapping, stream: bool) -> bool:
    """include_usage of ``stream_options`` (only allowed with ``stream``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", f"must be an object, got {options!r}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid(
            "stream_options.include_usage", f"must be true or false, got {include_usage!r}"
        )
    return include_usage


def _model(body: Mapping, served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the name of the model (GET /v1/models lists it)")
    if model != served:
        raise model_not_found(model, served)
    return model


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist; this server serves `{served}`.",
        param="model",
        code="model_not_found",
    )


# ---- the request ------------------------------------------------------------------------
@dataclass
class Generation:
    """One OpenAI request as the orchestrator's request, plus how to answer it."""

    request: orchestrator_pb2.GenerateRequest
    model: str
    stream: bool
    include_usage: bool
    # Chat only: how the conversation became a prompt, "model" or "plain-text"
    # (gateway.chat_template), sent back in the x-specdec-chat-template header.
    chat_template: str | None = None
    # The gRPC request's fields as this request's OpenAI fields, where they differ from
    # the endpoint's (``Shape.field_names``): a chat's limit may be max_completion_tokens.
    field_names: Mapping[str, str] | None = None


def _sampling(body: Mapping, max_tokens: int | None, default_max_tokens: int) -> dict:
    """The GenerateRequest fields every endpoint shares, validated."""
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise invalid("n", f"only n=1 is supported (one choice per request), got {n!r}")
    fields: dict[str, Any] = {
        "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": _int(body, "top_k", 0, 0),
        "stop": _stop(body),
    }
    seed = _int(body, "seed", None, MIN_SEED, MAX_SEED)
    if seed is not None:
        fields["seed"] = seed % 2**64
    gamma = _int(body, "gamma", None, 0)
    if gamma is not None:
        fields["gamma"] = gamma
    if body.get("overlap") is not None:
        fields["overlap"] = _bool(body, "overlap")
    for name in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(body, name, (0, 0.0), "penalties change the output distribution")
    _refuse_unless(body, "logit_bias", ({},), "it changes the output distribution")
    return fields


def _prompt(body: Mapping) -> dict:
    """``text`` or ``token_ids`` from ``prompt``: a string, or token ids, or a list of one."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise invalid("prompt", "must not be empty")
        return {"text": p}
    if isinstance(p, list) and p and all(_is_int(t) and 0 <= t <= INT32_MAX for t in p):
        return {"token_ids": orchestrator_pb2.TokenIds(ids=p)}
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise invalid("prompt", f"one prompt per request is supported, got {len(p)}")
    raise invalid(
        "prompt",
        "must be a non-empty string or a non-empty list of token ids"
        f" (integers in [0, {INT32_MAX}])",
    )


def _content(i: int, content: Any) -> str:
    """A message's text: a string, or text content parts joined by newlines."""
    where = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(where, f"only text content parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise invalid(where, "a text part needs a string `text`")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(where, f"must be a string or a list of text parts, got {content!r}")


def _messages(body: Mapping) -> list[tuple[str, str]]:
    """(role, content) of each message; ``developer`` is passed on as ``system``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"must be an object, got {m!r}")
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise unsupported(f"messages[{i}].role", "no tool calling")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {list(CHAT_ROLES)}, got {role!r}")
        out.append(("system" if role == "developer" else role, _content(i, m.get("content"))))
    return out


def plain_text_chat(messages: Iterable[tuple[str, str]]) -> str:
    """A conversation as plain text, for a model without a chat template.

    One ``role: content`` line per message, then ``assistant:`` for the model
    to continue; for example ``system: Be brief.\\nuser: Hi\\nassistant:``.
    """
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


# ---- responses ----------------------------------------------------------------------------
def finish_reason(stats: orchestrator_pb2.GenerationStats) -> str:
    """OpenAI's finish_reason: ``length``, or ``stop`` (EOS or a stop string)."""
    return "length" if stats.finish_reason == "length" else "stop"


def usage(stats: orchestrator_pb2.GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def speculation(stats: orchestrator_pb2.GenerationStats) -> dict:
    """The ``specdec`` extension object: the request's speculative-decoding statistics."""
    return {
        "acceptance_rate": round(stats.acceptance_rate, 6),
        "mean_accepted_length": round(stats.mean_accepted_length, 6),
        "wire_bytes_per_token": round(stats.wire_bytes_per_token, 3),
        "gamma": stats.gamma,
        "steps": stats.steps,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "fallback_steps": stats.fallback_steps,
        "round_trips": stats.round_trips,
        "adaptive": stats.adaptive,
        "mean_gamma": round(stats.mean_gamma, 6),
        "overlapped_steps": stats.overlapped_steps,
        "judged_tokens": stats.judged_tokens,
        "time_to_first_token_s": round(stats.time_to_first_token_s, 6),
        "tokens_per_second": round(stats.tokens_per_second, 3),
        "total_time_s": round(stats.total_time_s, 6),
        "finish_reason": stats.finish_reason,
    }


def sse(event: dict) -> bytes:
    """One server-sent event: ``data: <compact JSON>`` and a blank line."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class _Shape:
    """What the two generating endpoints share: the id, the timestamps, the usage chunk."""

    id_prefix = ""
    endpoint = ""
    chunk_object = ""
    # The gRPC request's field names as this endpoint's OpenAI fields (for errors).
    field_names: Mapping[str, str] = {}

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _object(self, kind: str, choices: list, **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def _chunk_usage(self) -> dict:
        # With include_usage every chunk has "usage": null, and one more chunk the usage.
        return {"usage": None} if self.include_usage else {}

    def usage_event(self, stats: orchestrator_pb2.GenerationStats) -> list[bytes]:
        if not self.include_usage:
            return []
        return [sse(self._object(self.chunk_object, [], usage=usage(stats)))]


class CompletionShape(_Shape):
    """``POST /v1/completions``: ``text_completion`` objects."""

    id_prefix = "cmpl"
    endpoint = "/v1/completions"
    chunk_object = "text_completion"
    field_names = {"text": "prompt", "token_ids": "prompt", "max_new_tokens": "max_tokens"}

    @staticmethod
    def parse(body: Mapping, served_model: str, cfg: GatewayConfig) -> Generation:
        model = _model(body, served_model)
        stream = _bool(body, "stream")
        include_usage = _stream_options(body, stream)
        _refuse_unless(body, "echo", (False,), "the prompt is not echoed")
        # (0 too: OpenAI then still returns the sampled tokens' log probabilities.)
        _refuse_unless(body, "logprobs", (), "no log probabilities")
        _refuse_unless(body, "best_of", (1,), "one candidate per request")
        _refuse_unless(body, "suffix", ("",), "no insertion")
        max_tokens = _int(body, "max_tokens", None, 1)
        fields = _sampling(body, max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        request = orchestrator_pb2.GenerateRequest(**_prompt(body), **fields)
        return Generation(request, model, stream, include_usage)

    def start_events(self) -> list[bytes]:
        return []

    def text_event(self, text: str) -> bytes:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": None}
        return sse(self._object("text_completion", [choice], **self._chunk_usage()))

    def final_events(self, stats: orchestrator_pb2.GenerationStats) -> list[bytes]:
        choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": finish_reason(stats)}
        last = self._object(
            "text_completion", [choice], **self._chunk_usage(), specdec=speculation(stats)
        )
        return [sse(last), *self.usage_event(stats)]

    def body(self, text: str, stats: orchestrator_pb2.GenerationStats) -> dict:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason(stats)}
        return self._object(
            "text_completion", [choice], usage=usage(stats), specdec=speculation(stats)
        )


class ChatShape(_Shape):
    """``POST /v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk``."""

    id_prefix = "chatcmpl"
    endpoint = "/v1/chat/completions"
    chunk_object = "chat.completion.chunk"
    field_names = {"text": "messages", "max_new_tokens": "max_tokens"}

    @staticmethod
    def parse(body: Mapping, served_model: str, cfg: GatewayConfig) -> Generation:
        model = _model(body, served_model)
        messages = _messages(body)
        stream = _bool(body, "stream")
        include_usage = _stream_options(body, stream)
        _refuse_unless(body, "logprobs", (False,), "no log probabilities")
        _refuse_unless(body, "top_logprobs", (0,), "no log probabilities")
        _refuse_unless(body, "tools", ([],), "no tool calling")
        _refuse_unless(body, "functions", ([],), "no tool calling")
        _refuse_unless(body, "tool_choice", ("none",), "no tool calling")
        _refuse_unless(body, "function_call", ("none",), "no tool calling")
        _refuse_unless(body, "response_format", ({"type": "text"},), "text responses only")
        _refuse_unless(body, "modalities", (["text"],), "text responses only")
        _refuse_unless(body, "audio", (), "text responses only")
        # max_completion_tokens replaces max_tokens in OpenAI's current API; both work.
        max_tokens = _int(body, "max_completion_tokens", None, 1)
        names = None
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, 1)
        else:
            names = {**ChatShape.field_names, "max_new_tokens": "max_completion_tokens"}
        fields = _sampling(body, max_tokens, cfg.default_max_tokens)
        if cfg.chat_template == "plain-text":
            prompt = {"text": plain_text_chat(messages)}
        else:  # the orchestrator renders them with the target tokenizer's chat template
            turns = [orchestrator_pb2.ChatMessage(role=r, content=c) for r, c in messages]
            prompt = {"messages": orchestrator_pb2.ChatMessages(messages=turns)}
        request = orchestrator_pb2.GenerateRequest(**prompt, **fields)
        return Generation(request, model, stream, include_usage, cfg.chat_template, names)

    def _chunk(self, delta: dict, finish: str | None, **extra) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._object("chat.completion.chunk", [choice], **self._chunk_usage(), **extra)

    def start_events(self) -> list[bytes]:
        return [sse(self._chunk({"role": "assistant", "content": ""}, None))]

    def text_event(self, text: str) -> bytes:
        return sse(self._chunk({"content": text}, None))

    def final_events(self, stats: orchestrator_pb2.GenerationStats) -> list[bytes]:
        last = self._chunk({}, finish_reason(stats), specdec=speculation(stats))
        return [sse(last), *self.usage_event(stats)]

    def body(self, text: str, stats: orchestrator_pb2.GenerationStats) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason(stats),
        }
        return self._object(
            "chat.completion", [choice], usage=usage(stats), specdec=speculation(stats)
        )


def error_event(error: ApiError) -> bytes:
    """An error after the stream has begun (the HTTP status is already 200)."""
    return sse(error.body())


def model_object(name: str, created: int, info: orchestrator_pb2.OrchestratorInfo) -> dict:
    """``GET /v1/models/{model}``: the model this gateway serves, with its pair in ``specdec``."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "specdec",
        "specdec": {
            "draft_model_id": info.draft_model_id,
            "target_model_id": info.target_model_id,
            "vocab_size": info.vocab_size,
            "default_gamma": info.default_gamma,
            "max_gamma": info.max_gamma,
            "max_new_tokens": info.max_new_tokens,
            "max_prompt_tokens": info.max_prompt_tokens,
            "server_version": info.server_version,
        },
    }


def models_body(name: str, created: int, info: orchestrator_pb2.OrchestratorInfo) -> dict:
    """``GET /v1/models``: the one model this gateway serves."""
    return {"object": "list", "data": [model_object(name, created, info)]}
