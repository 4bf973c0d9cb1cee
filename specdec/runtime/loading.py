"""Loading a causal LM and its tokenizer, and what identifies them.

Not for: running the model (``specdec.runtime.ragged``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from specdec.config import ConfigError

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# Bytes read from each weight file for the fingerprint: evenly spaced chunks.
_SAMPLE_CHUNKS, _CHUNK_BYTES = 64, 1 << 16


@dataclass(frozen=True)
class ModelInfo:
    """What a model service tells about itself."""

    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    dtype: str
    device: str
    architecture: str
    eos_token_ids: tuple[int, ...]
    max_context: int
    model_fingerprint: str
    server_version: str
    protocol_version: int
    head_fingerprint: str = ""  # a quantized draft output layer's (specdec.hidden_q)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def check_model_path(key: str, path: str) -> None:
    """A ConfigError naming ``key`` for a model path that is plainly local (absolute,
    relative with ./ or ../, or deeper than a hub id's ``owner/name``) and missing,
    before transformers tries it as a hub id (and the network) for half a minute."""
    if Path(path).expanduser().exists():
        return
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        raise ConfigError(f"{key}: no such model directory: {path}")


def check_device(key: str, device: str) -> None:
    """A ConfigError naming ``key`` unless ``device`` is one this machine has (the
    config checks only its kind: cpu or cuda). Before, a missing GPU or a wrong index
    failed deep in loading, with torch's own message."""
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"{key}: {device!r} is not a device ({e})") from None
    if d.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {device!r}, but this machine has no usable CUDA device")
    if d.index is not None and d.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError(f"{key}: {device!r}, but this machine has {count} CUDA device(s)")


def load_model(
    path: str,
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
    quiet: bool = False,
):
    """A causal LM in eval mode on ``device`` cast to ``dtype``.

    Prefers safetensors; never runs a model's own code unless asked to.
    ``quiet`` hides transformers' per-file progress bars.
    """
    has_safetensors = any(Path(path).glob("*.safetensors")) if Path(path).is_dir() else None
    if quiet:
        hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=DTYPES[dtype],
        trust_remote_code=trust_remote_code,
        use_safetensors=True if has_safetensors else None,
    )
    return model.to(device).eval()


def pad_vocab(model, size: int, field: str) -> None:
    """Grow ``model``'s vocabulary to ``size`` tokens, with rows of zeros in its input
    embedding and its output layer (tied or not): a draft paired with a target whose
    embedding table is padded further (``ModelServiceConfig.pad_vocab``). A new
    token's logit is 0; the draft may propose one, rarely, and embed one the target
    drew. Exactness never depends on what the draft proposes (its q is sent as it
    drew from it), only acceptance does."""
    have = model.get_input_embeddings().weight.shape[0]
    if size < have:
        raise ConfigError(f"{field}: must be 0 or at least the model's {have} tokens, got {size}")
    if size == have:
        return
    model.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[have:].zero_()
        out = model.get_output_embeddings()
        if out is not None:
            out.weight[have:].zero_()
            if getattr(out, "bias", None) is not None:
                out.bias[have:].zero_()


def load_output_layer(path: str, trust_remote_code: bool = False):
    """The model built on the meta device (no memory for its weights) and its output
    layer's weight [vocab, d] in float32 on the CPU, read alone from the safetensors
    checkpoint in the directory ``path``; None where that cannot be done (not a local
    directory of safetensors, or the checkpoint names the weight differently): then
    load the whole model. What a target needs of the draft for the hidden-state wire
    (``specdec.hidden_q``), without holding the draft's layers even for a moment."""
    try:
        return _output_layer_alone(Path(path), trust_remote_code)
    except Exception:  # the whole model's load then says what is wrong
        return None


def _output_layer_alone(root: Path, trust_remote_code: bool):
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(root / "model.safetensors", "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        return None
    config = AutoConfig.from_pretrained(str(root), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if weight is None:
        return None
    # Every name of the weight (a tied one has two), then without the base model's
    # prefix (older checkpoints of some families store them so).
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]
    prefix = f"{model.base_model_prefix}."
    names += [n.removeprefix(prefix) for n in names if n.startswith(prefix)]
    for name in names:
        if name in weight_map:
            with safe_open(root / weight_map[name], "pt", device="cpu") as f:
                tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(weight.shape):
                return None
            return model.eval(), tensor.to(torch.float32)
    return None


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 over the vocabulary and special tokens: equal iff the tokenizers agree."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(map(str, tokenizer.all_special_tokens))
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def eos_token_ids(model) -> list[int]:
    """Every end-of-sequence id the model's config and generation_config name, in order."""
    ids: list[int] = []
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for eos in value if isinstance(value, list | tuple) else [value]:
            if eos is not None and int(eos) not in ids:
                ids.append(int(eos))
    return ids


def position_limit(model) -> int | None:
    """Most positions the model can embed: the size of its table of absolute positions
    (GPT-2's ``n_positions``), or None for rotary models, which have no such table."""
    if any("Rotary" in type(m).__name__ for m in model.modules()):
        return None
    limit = getattr(model.config, "max_position_embeddings", None)
    return int(limit) if limit else None


def model_fingerprint(path: str, model, dtype: str) -> str:
    """SHA-256 over the config, a sample of every weight file and the served dtype.

    Reads at most 4 MiB per weight file, so it is cheap for any model size;
    two checkpoints that differ anywhere in their weights differ in (nearly)
    every sampled chunk. A model without files (built in memory) is
    fingerprinted by its parameters.
    """
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(dtype.encode())
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")) if root.is_dir() else []
    if not files:
        for name, p in sorted(model.state_dict().items()):
            h.update(name.encode())
            # (the first chunk's elements only: not the whole tensor through float32
            # and to the host; the same bytes)
            head = p.detach().reshape(-1)[: _CHUNK_BYTES // 4]
            h.update(head.float().cpu().numpy().tobytes())
        return h.hexdigest()
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            step = max(_CHUNK_BYTES, size // _SAMPLE_CHUNKS)
            for offset in range(0, size, step):
                fh.seek(offset)
                h.update(fh.read(_CHUNK_BYTES))
    return h.hexdigest()


def set_threads(n: int) -> None:
    """Torch CPU threads for this process (0 keeps torch's default)."""
    if n:
        torch.set_num_threads(n)
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
