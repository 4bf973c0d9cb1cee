"""Tiny random models and a character tokenizer, built from configs for tests.

Nothing is downloaded. Output layers are scaled up so that distributions are
peaked (as a trained model's are); otherwise a random model is nearly uniform
and a broken sampler would be hard to tell from a correct one.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CHARS = string.ascii_lowercase + string.ascii_uppercase[:10] + " .,;!?'-\n"
EOS = "<eos>"
UNK = "<unk>"
# A chat template in the tokenizer's own characters (no ':'), so that a
# conversation it renders differs from the gateway's plain-text fallback.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}; {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant;{% endif %}"
)


def build_tokenizer(out: Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The character tokenizer, saved to ``out``; with a chat template if given."""
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab[UNK] = len(vocab)
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, eos_token=EOS)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def vocab_size() -> int:
    return len(CHARS) + 2


def build_model(
    kind: str,
    out: Path,
    layers: int,
    width: int,
    seed: int,
    sharpen: float = 6.0,
    eos: bool = False,
) -> Path:
    """A random causal LM of family ``kind`` ("llama" or "gpt2") saved with its tokenizer."""
    torch.manual_seed(seed)
    v = vocab_size()
    eos_id = v - 1 if eos else None
    if kind == "llama":
        cfg = LlamaConfig(
            vocab_size=v,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            eos_token_id=eos_id,
            bos_token_id=None,
            pad_token_id=None,
        )
        model = LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=v,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            n_positions=1024,
            tie_word_embeddings=False,
            eos_token_id=eos_id,
            bos_token_id=eos_id,
            pad_token_id=None,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


def build_pair(root: Path, kind: str = "llama", eos: bool = False) -> tuple[Path, Path]:
    """(draft dir, target dir): a 1-layer draft and a 2-layer target of one family."""
    target = build_model(kind, root / f"{kind}-target", layers=2, width=64, seed=1, eos=eos)
    draft = build_model(kind, root / f"{kind}-draft", layers=1, width=32, seed=2, eos=eos)
    return draft, target
