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
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
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


# ---- one tiny model per family -------------------------------------------------------------
# The families the ragged runtime is tested on (tests/test_families.py, docs/models.md).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "phi3", "gpt_neox", "opt")
# Sliding window of the windowed families, far shorter than the tests' sequences.
WINDOW = 8


def family_config(
    kind: str, layers: int, width: int, eos_id: int | None, vocab: int | None = None
) -> PretrainedConfig:
    """A tiny config of family ``kind`` (4 heads, 2 key/value heads where the family has GQA).

    Windowed families get a window of WINDOW tokens: Mistral and Phi-3 on every layer,
    Qwen2 and Qwen3 from the second layer on (``max_window_layers=1``: full, then sliding),
    Gemma-2 alternating sliding and global, with soft-capped attention scores (cap 3,
    with weights large enough for the cap to change them) and soft-capped logits.
    """
    v = vocab or vocab_size()
    ids = dict(eos_token_id=eos_id, bos_token_id=None, pad_token_id=None)
    llama_like = dict(
        vocab_size=v,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **ids,
    )
    if kind == "llama":
        return LlamaConfig(**llama_like)
    if kind == "qwen2":
        return Qwen2Config(
            **llama_like, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
    if kind == "qwen3":  # Qwen2's hybrid windows, and q/k norms in the attention
        return Qwen3Config(
            **llama_like, head_dim=width // 4, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1,
        )  # fmt: skip
    if kind == "mistral":
        return MistralConfig(**llama_like, sliding_window=WINDOW)
    if kind == "gemma2":
        return Gemma2Config(
            **llama_like,
            head_dim=width // 4,
            query_pre_attn_scalar=width // 4,
            sliding_window=WINDOW,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=30.0,
            initializer_range=0.1,  # attention scores large enough for the cap to bite
        )
    if kind == "phi3":
        return Phi3Config(**llama_like, sliding_window=WINDOW)
    if kind == "gpt2":
        return GPT2Config(
            vocab_size=v, n_embd=width, n_layer=layers, n_head=4, n_positions=1024,
            tie_word_embeddings=False, **ids,
        )  # fmt: skip
    if kind == "gpt_neox":
        return GPTNeoXConfig(
            vocab_size=v, hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False, **ids,
        )  # fmt: skip
    if kind == "opt":
        return OPTConfig(
            vocab_size=v, hidden_size=width, ffn_dim=2 * width, word_embed_proj_dim=width,
            num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False, **ids,
        )  # fmt: skip
    if kind == "bloom":  # ALiBi: the ragged runtime refuses it (no position-free bias yet)
        return BloomConfig(vocab_size=v, hidden_size=width, n_layer=layers, n_head=4, **ids)
    raise ValueError(kind)


def build_family(
    kind: str,
    out: Path,
    layers: int = 2,
    width: int = 64,
    seed: int = 1,
    sharpen: float = 6.0,
    eos: bool = False,
    dtype: torch.dtype = torch.float32,
    perturb: float = 0.0,
    pieces: bool = False,
) -> Path:
    """A random causal LM of family ``kind`` (see FAMILIES) saved with the char tokenizer.

    ``perturb`` adds Gaussian noise of that many times each weight tensor's standard
    deviation (seeded by ``seed + 1000``): a draft that agrees with its target often,
    but not always. ``pieces``: the multi-character tokenizer (``build_piece_tokenizer``).
    """
    torch.manual_seed(seed)
    v = len(PIECES) + 1 if pieces else vocab_size()
    eos_id = v - 1 if eos else None
    model = AutoModelForCausalLM.from_config(family_config(kind, layers, width, eos_id, v))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
        if perturb:
            g = torch.Generator().manual_seed(seed + 1000)
            for p in model.parameters():
                scale = float(p.std()) if p.numel() > 1 else 0.0
                p.add_(torch.randn(p.shape, generator=g) * perturb * scale)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out)
    (build_piece_tokenizer if pieces else build_tokenizer)(out)
    return out


def build_family_pair(
    root: Path, kind: str, perturb: float = 0.1, pieces: bool = False
) -> tuple[Path, Path]:
    """(draft dir, target dir) of family ``kind``: the draft is the 2-layer target
    with noise on its weights, so that drafts are accepted often but not always
    (a random 1-layer draft would be rejected at almost every position)."""
    target = build_family(kind, root / f"{kind}-target", seed=1, pieces=pieces)
    draft = build_family(kind, root / f"{kind}-draft", seed=1, perturb=perturb, pieces=pieces)
    return draft, target


# ---- a tokenizer of multi-character tokens -------------------------------------------------
# Single characters and longer pieces, so that a stop string can start in the middle of a
# token (the character tokenizer cannot show that).
PIECES = list(string.ascii_lowercase[:12]) + [
    " ", ".", "the", " and", "ing", "er", "on", "st", " of", "ed", "abc", "cab",
    "ll", "ee", " to", "ion", "ent", "at", "he", "in", "ou", "es",
]  # fmt: skip


def build_piece_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer over PIECES (ids 0..len-1) and EOS (the last id); decoding
    concatenates the pieces. Prompts are given as token ids."""
    vocab = {p: i for i, p in enumerate(PIECES)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=EOS, eos_token=EOS)
    fast.save_pretrained(out)
    return fast


def build_large_vocab_pair(root: Path, vocab: int = 151_936) -> tuple[Path, Path]:
    """(draft dir, target dir): tiny random Qwen2 models with Qwen2.5's vocabulary size,
    and a word-level tokenizer of that many tokens (for wire-size measurements)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    pieces = {f"t{i}": i for i in range(vocab - 2)}
    pieces[UNK] = vocab - 2
    pieces[EOS] = vocab - 1
    tok = Tokenizer(models.WordLevel(pieces, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, eos_token=EOS)
    out = []
    for name, layers, seed in (("draft", 1, 2), ("target", 2, 1)):
        torch.manual_seed(seed)
        cfg = Qwen2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            eos_token_id=None,
            bos_token_id=None,
        )
        model = Qwen2ForCausalLM(cfg)
        path = root / f"qwen-{vocab}-{name}"
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        fast.save_pretrained(path)
        out.append(path)
    return out[0], out[1]
