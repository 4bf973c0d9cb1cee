"""A Generate request, validated: every field checked, errors naming the field
and the allowed range. The one place the public request is read.
Not for: running it (``orchestrator.engine``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from specdec.config import OrchestratorConfig
from specdec.errors import CONTEXT_LENGTH, InvalidArgument, require
from specdec.runtime.loading import ModelInfo
from specdec.sampling import SamplingParams
from specdec.v1 import orchestrator_pb2
from specdec.wire import MIN_TEMPERATURE, check_params, check_tokens

MAX_STOP_CHARS = 256


@dataclass
class RequestSpec:
    """A validated Generate request."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int | None  # None: chosen at every step (adaptive)
    stops: list[str]
    seed: int  # 64 bits
    dense: bool
    overlap: bool  # draft the next block while the target verifies

    @property
    def max_gamma(self) -> int:
        """The most tokens a step of this request may draft."""
        return self.gamma if self.gamma is not None else self.max_adaptive_gamma

    max_adaptive_gamma: int = 0


def chat_prompt(tokenizer, messages) -> list[int]:
    """Token ids of a conversation, rendered by the tokenizer's chat template."""
    require(len(messages) > 0, "messages", "must hold at least one message")
    for i, m in enumerate(messages):
        require(m.role != "", f"messages[{i}].role", "must not be empty")
    require(
        bool(getattr(tokenizer, "chat_template", None)),
        "messages",
        "the target's tokenizer has no chat template; send the prompt as text instead",
    )
    turns = [{"role": m.role, "content": m.content} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(
            turns, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as e:  # the template itself refuses (e.g. roles out of order)
        raise InvalidArgument("messages", f"the chat template refused them: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    require(len(ids) > 0, "messages", "render to no tokens")
    return list(ids)


def parse(
    r: orchestrator_pb2.GenerateRequest,
    o: OrchestratorConfig,
    tokenizer,
    target: ModelInfo,
    draft: ModelInfo | None,
    target_max_context: int,
) -> RequestSpec:
    """Validate every field of ``r``."""
    kind = r.WhichOneof("prompt")
    require(kind is not None, "prompt", "set text, token_ids or messages")
    if kind == "text":
        require(r.text != "", "text", "must not be empty")
        prompt = tokenizer.encode(r.text)
        require(len(prompt) > 0, "text", "encodes to no tokens")
    elif kind == "messages":
        prompt = chat_prompt(tokenizer, r.messages.messages)
    else:
        prompt = check_tokens("token_ids", r.token_ids.ids, target.vocab_size, min_len=1)
    require(
        len(prompt) <= o.max_prompt_tokens,
        kind,
        f"prompt has {len(prompt)} tokens, over the limit of {o.max_prompt_tokens} (this "
        f"server's {CONTEXT_LENGTH} for a prompt)",
    )
    require(
        1 <= r.max_new_tokens <= o.max_new_tokens,
        "max_new_tokens",
        f"must be in [1, {o.max_new_tokens}], got {r.max_new_tokens}",
    )
    temperature = r.temperature
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = 0.0  # a vanishing temperature is greedy decoding (and 1e-38 would overflow)
    # A top_k of the whole vocabulary or more removes nothing: it is no top-k (so the
    # draft sends q with its tail, and acceptance does not drop for nothing).
    top_k = r.top_k if r.top_k < target.vocab_size else 0
    params = check_params(temperature, top_k, r.top_p)
    gamma: int | None = r.gamma if r.HasField("gamma") else None
    if gamma is None and (not o.adaptive_gamma or r.HasField("seed")):
        # A seeded request must give the same output every time: the adaptive choice
        # of gamma depends on measured timings, so it uses the configured gamma.
        gamma = o.gamma
    require(
        gamma is None or 0 <= gamma <= o.max_gamma,
        "gamma",
        f"must be in [0, {o.max_gamma}], got {gamma}",
    )
    require(
        len(r.stop) <= o.max_stop_sequences,
        "stop",
        f"at most {o.max_stop_sequences} stop strings, got {len(r.stop)}",
    )
    for s in r.stop:
        require(
            0 < len(s) <= MAX_STOP_CHARS,
            "stop",
            f"each stop string must have 1..{MAX_STOP_CHARS} characters",
        )
    room = min(target_max_context, target.max_context or 1 << 30)
    most = o.max_gamma if gamma is None else gamma
    if most and draft is not None:
        room = min(room, draft.max_context or room)
    need = len(prompt) + r.max_new_tokens + most + 1
    require(
        need <= room,
        # The prompt's field when it leaves no room for even one token.
        kind if need - r.max_new_tokens + 1 > room else "max_new_tokens",
        f"the model's {CONTEXT_LENGTH} is {room} tokens, and the prompt ({len(prompt)}) + "
        f"max_new_tokens ({r.max_new_tokens}) + gamma + 1 (a speculative step's room) "
        "exceeds it",
    )
    return RequestSpec(
        prompt=prompt,
        max_new_tokens=r.max_new_tokens,
        params=params,
        gamma=gamma,
        stops=list(r.stop),
        seed=r.seed if r.HasField("seed") else secrets.randbits(64),
        dense=r.dense,
        # In one process (local_models) the two models' passes share one event loop:
        # a block drafted during a verify would only wait for it.
        overlap=(r.overlap if r.HasField("overlap") else o.overlap) and not o.local_models,
        max_adaptive_gamma=o.max_gamma,
    )
