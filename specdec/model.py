"""Loading a causal LM and running it over one KV cache per session.

``KVSession`` owns a session's cache and its length; ``truncate`` is the only
way a cache shrinks. ``ModelRunner`` owns the model and runs forwards on one
worker thread, off the gRPC event loop.
Not for: sampling (``specdec.sampling``) or the wire (the services).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specdec.errors import FailedPrecondition

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def load_tokenizer(path: str, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_model(
    path: str, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False
):
    """A causal LM in eval mode on ``device`` cast to ``dtype``.

    Prefers safetensors; never runs a model's own code unless asked to.
    """
    has_safetensors = any(Path(path).glob("*.safetensors")) if Path(path).is_dir() else None
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=DTYPES[dtype],
        trust_remote_code=trust_remote_code,
        use_safetensors=True if has_safetensors else None,
    )
    return model.to(device).eval()


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 over the vocabulary and special tokens: equal iff the tokenizers agree."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(map(str, tokenizer.all_special_tokens))
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class KVSession:
    """One session's KV cache. The orchestrator owns the token history; this
    object only knows how many tokens its cache holds."""

    session_id: str
    cache: DynamicCache
    length: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def truncate(self, length: int) -> int:
        """Drop cached tokens beyond ``length``; returns how many were dropped."""
        if length > self.length:
            raise FailedPrecondition(
                f"cache_len: session {self.session_id} holds {self.length} tokens, "
                f"cannot roll back to {length}"
            )
        removed = self.length - length
        if removed:
            self.cache.crop(-removed)  # transformers 5.x: a negative count removes tokens
            self.length = length
        return removed


class ModelRunner:
    """A model and its forward pass over a session's cache."""

    def __init__(self, model, device: str) -> None:
        self.model = model
        self.device = torch.device(device)
        self.vocab_size: int = model.config.vocab_size

    def new_session(self, session_id: str) -> KVSession:
        return KVSession(session_id, DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(
        self, session: KVSession, tokens: list[int], logits_to_keep: int = 1
    ) -> torch.Tensor:
        """Feed ``tokens`` after the cached ones; returns logits [logits_to_keep, vocab].

        The last ``logits_to_keep`` rows predict the tokens after each of the
        last fed positions. Logits stay on the model's device (the sampling math
        runs there too; only sparse results cross to the CPU), in float32 or wider.
        """
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, t]
        out = self.model(
            input_ids=ids, cache=session.cache, use_cache=True, logits_to_keep=logits_to_keep
        )
        session.length += len(tokens)
        logits = out.logits[0, -logits_to_keep:]  # [logits_to_keep, vocab]
        if logits.dtype != torch.float64:
            logits = logits.float()
        return logits
