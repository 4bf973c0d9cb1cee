#!/usr/bin/env python
"""Train the demo draft/target model pair for specdec (project issue 3).

Pipeline (everything runs on CPU, no network):

  1. corpus    Jane Austen's six novels, read from the Debian package
               ``r-cran-janeaustenr`` (MIT licence; the data is a zlib-compressed
               R lazy-load database, read with the ``rdata`` package).
               Optionally Moby Dick from ``r-cran-tokenizers`` (--moby-dick).
               The END of every book is held out for validation.
  2. tokenizer byte-level BPE (``tokenizers``), ``<|endoftext|>`` = eos/bos/pad,
               saved as a PreTrainedTokenizerFast into BOTH model directories.
  3. target    Llama-family causal LM trained from scratch (bf16 autocast).
  4. draft     tiny 1-layer Llama trained normally, then distilled towards the
               target with a forward-KL fine-tune (raises acceptance alpha).
  5. measure   ``models/measure_pair.py``: val perplexity, alpha, greedy
               agreement, cost ratio c, expected speedups -> metrics.json and
               MODEL_CARD.md.

The wall-clock budget (``--budget-minutes``) is split between the phases by the
fractions in ``HP``; learning-rate schedules follow the fraction of each
phase's time budget that has elapsed, so a longer budget simply trains longer.
Seeds are fixed; with a time budget the number of optimiser steps depends on
the machine's speed (it is recorded in metrics.json).

Rebuild:
  apt-get install -y r-cran-janeaustenr && .venv/bin/python models/train_demo.py --budget-minutes 55 --out models/demo
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field

# --------------------------------------------------------------------------
# All hyper-parameters in one place.
# --------------------------------------------------------------------------


@dataclass
class ModelHP:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


@dataclass
class HP:
    seed: int = 1234
    num_threads: int = 2  # torch intra-op threads (machine has 2 cores)
    # corpus / tokenizer
    val_fraction: float = 0.05  # last 5% (by characters) of EVERY book is validation
    vocab_size: int = 4096
    bpe_min_frequency: int = 2
    eos_token: str = "<|endoftext|>"
    # training (shared)
    seq_len: int = 256
    autocast_bf16: bool = True
    grad_clip: float = 1.0
    eval_every_s: float = 120.0
    eval_windows: int = 24  # windows of seq_len used for in-training val loss
    # budget split (fractions of --budget-minutes); the remainder is measurement + saving
    frac_target: float = 0.62
    frac_draft: float = 0.12
    frac_distill: float = 0.20
    # target
    target: ModelHP = field(
        default_factory=lambda: ModelHP(
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=6,
            num_key_value_heads=6,
        )
    )
    target_lr: float = 1.5e-3
    target_batch: int = 16
    target_warmup_frac: float = 0.04
    target_min_lr_frac: float = 0.1
    target_weight_decay: float = 0.1
    # draft
    draft: ModelHP = field(
        default_factory=lambda: ModelHP(
            hidden_size=160,
            intermediate_size=448,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    draft_lr: float = 4e-3
    draft_batch: int = 16
    draft_warmup_frac: float = 0.05
    draft_weight_decay: float = 0.05
    # distillation (forward KL(p_target || q_draft) at temperature 1, plus a little CE)
    distill_lr: float = 2e-3
    distill_batch: int = 16
    distill_ce_weight: float = 0.1
    distill_warmup_frac: float = 0.03
    # saving
    target_save_dtype: str = "bfloat16"  # weights on disk; config dtype stays float32
    draft_save_dtype: str = "float32"
    # --resume: continue an existing pair (target CE at a lower peak lr, then more distillation;
    # the draft CE phase is skipped)
    resume_lr_scale: float = 0.6
    resume_warmup_frac: float = 0.05


JANEAUSTENR_DIR = "/usr/lib/R/site-library/janeaustenr/data"
TOKENIZERS_DIR = "/usr/lib/R/site-library/tokenizers/data"
AUSTEN_BOOKS = [
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
]

# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def read_r_lazyload_db(data_dir: str) -> dict:
    """Read every object of an R lazy-load database (Rdata.rdx + Rdata.rdb).

    Rdata.rdx is a gzip-compressed serialised R list whose ``variables``
    element maps names to (offset, length) in Rdata.rdb; each chunk there is a
    4-byte big-endian uncompressed length followed by a zlib stream holding a
    serialised R object.
    """
    import warnings

    import rdata

    rdx = os.path.join(data_dir, "Rdata.rdx")
    rdb = os.path.join(data_dir, "Rdata.rdb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
        with open(rdx, "rb") as f:
            index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(f.read())))
        with open(rdb, "rb") as f:
            blob = f.read()
        out = {}
        for name, (off, length) in index["variables"].items():
            chunk = blob[int(off) + 4 : int(off) + int(length)]
            out[str(name)] = rdata.conversion.convert(
                rdata.parser.parse_data(zlib.decompress(chunk))
            )
    return out


def _paragraphs(lines) -> list[str]:
    paras, cur = [], []
    for line in lines:
        line = str(line).replace("\r", "").rstrip()
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return [re.sub(r" {2,}", " ", p) for p in paras]


_START = re.compile(r"^(VOLUME I|CHAPTER (1|I)|Chapter 1)$")
_END_MARKERS = {"THE END", "FINIS", "Finis", "A NOTE ON THE TEXT"}


def clean_austen(lines) -> list[str]:
    """Paragraphs of one novel: front matter (title, author, advertisement)
    and back matter (THE END / FINIS / the editor's note) removed."""
    paras = _paragraphs(lines)
    start = next(i for i, p in enumerate(paras) if _START.match(p))
    end = len(paras)
    for i in range(start, len(paras)):
        if paras[i] in _END_MARKERS:
            end = i
            break
    return paras[start:end]


def clean_moby_dick(text: str) -> list[str]:
    """Moby Dick without the Project Gutenberg licence header/footer."""
    text = text.replace("\ufeff", "").replace("\r\n", "\n")
    s = text.index("*** START OF THIS PROJECT GUTENBERG EBOOK")
    s = text.index("\n", s) + 1
    e = text.index("End of Project Gutenberg")
    body = text[s:e]
    body = body[body.index("ETYMOLOGY.") :] if "ETYMOLOGY." in body else body
    return _paragraphs(body.split("\n"))


def load_corpus(hp: HP, moby_dick: bool = False):
    """Return (train_docs, val_docs): lists of strings, one per book."""
    if not os.path.exists(os.path.join(JANEAUSTENR_DIR, "Rdata.rdb")):
        sys.exit(
            f"error: Jane Austen corpus not found in {JANEAUSTENR_DIR}.\n"
            "Install the Debian package first:  apt-get install -y r-cran-janeaustenr"
        )
    try:
        import rdata  # noqa: F401
    except ImportError:
        sys.exit("error: the 'rdata' Python package is required (pip install rdata)")
    books = read_r_lazyload_db(JANEAUSTENR_DIR)
    paras_per_book = [(name, clean_austen(books[name])) for name in AUSTEN_BOOKS]
    if moby_dick:
        if not os.path.exists(os.path.join(TOKENIZERS_DIR, "Rdata.rdb")):
            sys.exit(
                f"error: {TOKENIZERS_DIR} not found; apt-get install -y r-cran-tokenizers "
                "(or drop --moby-dick)"
            )
        md = read_r_lazyload_db(TOKENIZERS_DIR)["mobydick"]
        paras_per_book.append(("mobydick", clean_moby_dick(str(md[0]))))
    train_docs, val_docs = [], []
    for _name, paras in paras_per_book:
        total = sum(len(p) + 2 for p in paras)
        acc, cut = 0, len(paras)
        for i, p in enumerate(paras):
            acc += len(p) + 2
            if acc >= (1.0 - hp.val_fraction) * total:
                cut = i + 1
                break
        train_docs.append("\n\n".join(paras[:cut]))
        val_docs.append("\n\n".join(paras[cut:]))
    return train_docs, val_docs


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(hp: HP, train_docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=hp.vocab_size,
        min_frequency=hp.bpe_min_frequency,
        special_tokens=[hp.eos_token],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # train on paragraphs (many short sequences) rather than 6 huge strings
    tok.train_from_iterator((p for d in train_docs for p in d.split("\n\n")), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=hp.eos_token,
        bos_token=hp.eos_token,
        pad_token=hp.eos_token,
        unk_token=hp.eos_token,
        model_max_length=hp.target.max_position_embeddings,
    )
    return fast


def encode_docs(tokenizer, docs: list[str]):
    import torch

    eos = tokenizer.eos_token_id
    ids = []
    for d in docs:
        ids.append(eos)
        ids.extend(tokenizer.backend_tokenizer.encode(d, add_special_tokens=False).ids)
    ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------
# Training helpers
# --------------------------------------------------------------------------


def set_seed(seed: int):
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_model(mhp: ModelHP, tokenizer, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=mhp.hidden_size,
        intermediate_size=mhp.intermediate_size,
        num_hidden_layers=mhp.num_hidden_layers,
        num_attention_heads=mhp.num_attention_heads,
        num_key_value_heads=mhp.num_key_value_heads,
        max_position_embeddings=mhp.max_position_embeddings,
        rope_theta=mhp.rope_theta,
        tie_word_embeddings=mhp.tie_word_embeddings,
        attention_dropout=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(cfg)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def get_batch(data, batch: int, seq_len: int, gen):
    import torch

    ix = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    x = torch.stack([data[i : i + seq_len + 1] for i in ix.tolist()])
    return x[:, :-1], x[:, 1:]


def lr_at(frac: float, base: float, warmup: float, min_frac: float) -> float:
    if frac < warmup:
        return base * max(frac / warmup, 0.02)
    prog = min(1.0, (frac - warmup) / max(1e-9, 1.0 - warmup))
    return base * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def val_windows(val, seq_len: int, n: int):
    """n evenly spaced, non-overlapping windows of the val stream (fixed)."""
    import torch

    starts = torch.linspace(0, len(val) - seq_len - 2, n).long().tolist()
    x = torch.stack([val[s : s + seq_len + 1] for s in starts])
    return x[:, :-1], x[:, 1:]


def eval_loss(model, xy, autocast: bool) -> float:
    import torch
    import torch.nn.functional as F

    x, y = xy
    model.eval()
    tot, cnt = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, len(x), 8):
            logits = model(input_ids=x[i : i + 8]).logits.float()
            tot += F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y[i : i + 8].reshape(-1), reduction="sum"
            ).item()
            cnt += y[i : i + 8].numel()
    model.train()
    return tot / cnt


class Progress:
    """tqdm over seconds of the phase budget if available, else periodic prints."""

    def __init__(self, desc: str, seconds: float):
        self.desc, self.total, self.last_print, self.shown = desc, seconds, 0.0, 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(
                total=int(seconds),
                desc=desc,
                unit="s",
                mininterval=5,
                bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {n:.0f}/{total:.0f}s {postfix}",
            )
        except ImportError:
            self.bar = None

    def update(self, elapsed: float, **post):
        if self.bar is not None:
            n = int(min(elapsed, self.total))
            if n > self.shown:
                self.bar.update(n - self.shown)
                self.shown = n
            self.bar.set_postfix(post, refresh=False)
        elif elapsed - self.last_print > 30:
            self.last_print = elapsed
            print(f"{self.desc}: {elapsed:.0f}/{self.total:.0f}s {post}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train_lm(
    name,
    model,
    train,
    val_xy,
    hp: HP,
    seconds,
    lr,
    batch,
    warmup,
    wd,
    teacher=None,
    ce_weight=1.0,
    min_lr_frac=0.1,
    log=print,
):
    """Train `model` for `seconds` of wall-clock time. If `teacher` is given,
    the loss is KL(p_teacher || q_model) + ce_weight * CE (distillation)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(hp.seed + zlib.crc32(name.encode()) % 1000)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    model.train()
    if teacher is not None:
        teacher.eval()
    prog = Progress(name, seconds)
    t0 = time.time()
    step, last_eval, tokens = 0, t0, 0
    ema = None
    history = []
    while True:
        el = time.time() - t0
        if el >= seconds:
            break
        cur_lr = lr_at(el / seconds, lr, warmup, min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        x, y = get_batch(train, batch, hp.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=hp.autocast_bf16):
            logits = model(input_ids=x).logits
        logits = logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if teacher is not None:
            with (
                torch.no_grad(),
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=hp.autocast_bf16),
            ):
                tlogits = teacher(input_ids=x).logits
            logp_t = F.log_softmax(tlogits.float(), -1)
            logq = F.log_softmax(logits, -1)
            kl = (logp_t.exp() * (logp_t - logq)).sum(-1).mean()
            loss = kl + ce_weight * ce
        else:
            kl = None
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        post = {"step": step, "loss": f"{ema:.3f}", "lr": f"{cur_lr:.1e}"}
        if kl is not None:
            post["kl"] = f"{kl.item():.3f}"
        if time.time() - last_eval > hp.eval_every_s:
            last_eval = time.time()
            vl = eval_loss(model, val_xy, hp.autocast_bf16)
            history.append(
                {"t": round(time.time() - t0, 1), "step": step, "val_loss": round(vl, 4)}
            )
            log(
                f"[{name}] t={time.time() - t0:.0f}s step={step} train_loss={ema:.3f} "
                f"val_loss={vl:.3f} val_ppl={math.exp(vl):.1f}"
            )
        prog.update(time.time() - t0, **post)
    prog.close()
    vl = eval_loss(model, val_xy, hp.autocast_bf16)
    history.append({"t": round(time.time() - t0, 1), "step": step, "val_loss": round(vl, 4)})
    log(
        f"[{name}] done: {step} steps, {tokens} tokens, {time.time() - t0:.0f}s, "
        f"val_loss={vl:.3f} val_ppl={math.exp(vl):.1f}"
    )
    model.eval()
    return {
        "steps": step,
        "tokens": tokens,
        "seconds": round(time.time() - t0, 1),
        "final_val_loss": round(vl, 4),
        "history": history,
    }


def save_model(model, tokenizer, out_dir: str, save_dtype: str):
    """save_pretrained (safetensors) with weights in `save_dtype`; the config's
    dtype is float32 so loading with dtype="auto" gives a float32 model."""
    import copy

    import torch

    os.makedirs(out_dir, exist_ok=True)
    m = copy.deepcopy(model).to(getattr(torch, save_dtype))
    m.config.use_cache = True
    m.save_pretrained(out_dir, safe_serialization=True)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = "float32"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tokenizer.save_pretrained(out_dir)
    # portable class name (transformers 5 writes its alias "TokenizersBackend")
    tc_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2, sort_keys=True)
        f.write("\n")
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        with open(gen_cfg) as f:
            g = json.load(f)
        g.update(
            {
                "bos_token_id": tokenizer.eos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.eos_token_id,
            }
        )
        with open(gen_cfg, "w") as f:
            json.dump(g, f, indent=2, sort_keys=True)
            f.write("\n")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--budget-minutes",
        type=float,
        default=55.0,
        help="total wall-clock budget, split between target / draft / distillation",
    )
    ap.add_argument(
        "--out",
        default="models/demo",
        help="output dir (gets target/, draft/, metrics.json, MODEL_CARD.md)",
    )
    ap.add_argument(
        "--moby-dick", action="store_true", help="also train on Moby Dick (r-cran-tokenizers)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (default HP.num_threads)"
    )
    ap.add_argument("--no-measure", action="store_true", help="skip measurement / model card")
    ap.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue training the pair in DIR (e.g. after a run on a busy machine); "
        "the budget is split as target / distill in the HP fractions",
    )
    args = ap.parse_args(argv)

    hp = HP()
    if args.threads:
        hp.num_threads = args.threads
    import torch

    torch.set_num_threads(hp.num_threads)
    set_seed(hp.seed)
    os.makedirs(args.out, exist_ok=True)
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    t_start = time.time()
    budget = args.budget_minutes * 60.0
    log(f"budget {args.budget_minutes} min; torch {torch.__version__}; threads {hp.num_threads}")

    # 1. corpus
    train_docs, val_docs = load_corpus(hp, args.moby_dick)
    log(
        f"corpus: {len(train_docs)} books, train {sum(map(len, train_docs))} chars, "
        f"val {sum(map(len, val_docs))} chars"
    )

    # 2. tokenizer
    tokenizer = train_tokenizer(hp, train_docs)
    previous = None
    if args.resume:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        old_tok = AutoTokenizer.from_pretrained(os.path.join(args.resume, "target"))
        if old_tok.get_vocab() != tokenizer.get_vocab():
            sys.exit("error: --resume: the retrained tokenizer differs from the saved one")
        prev_path = os.path.join(args.resume, "metrics.json")
        if os.path.exists(prev_path):
            with open(prev_path) as f:
                previous = json.load(f).get("training")
        log(f"resuming from {args.resume}")
    vocab = len(tokenizer)
    train_ids = encode_docs(tokenizer, train_docs)
    val_ids = encode_docs(tokenizer, val_docs)
    log(
        f"tokenizer: vocab {vocab}, eos id {tokenizer.eos_token_id}; "
        f"train {len(train_ids)} tokens, val {len(val_ids)} tokens"
    )
    vxy = val_windows(val_ids, hp.seq_len, hp.eval_windows)

    # 3. target
    set_seed(hp.seed + (2 if args.resume else 0))
    if args.resume:
        target = AutoModelForCausalLM.from_pretrained(
            os.path.join(args.resume, "target"), dtype=torch.float32
        )
        draft = AutoModelForCausalLM.from_pretrained(
            os.path.join(args.resume, "draft"), dtype=torch.float32
        )
        t_lr, t_warm = hp.target_lr * hp.resume_lr_scale, hp.resume_warmup_frac
    else:
        target = make_model(hp.target, tokenizer, vocab)
        t_lr, t_warm = hp.target_lr, hp.target_warmup_frac
    target.train()
    log(f"target: {n_params(target) / 1e6:.2f}M params")
    t_target = train_lm(
        "target",
        target,
        train_ids,
        vxy,
        hp,
        budget * hp.frac_target,
        t_lr,
        hp.target_batch,
        t_warm,
        hp.target_weight_decay,
        min_lr_frac=hp.target_min_lr_frac,
        log=log,
    )
    save_model(target, tokenizer, os.path.join(args.out, "target"), hp.target_save_dtype)

    # 4. draft: normal training, then distillation toward the target
    set_seed(hp.seed + 1)
    if args.resume:
        draft.train()
        t_draft = None
        distill_budget = budget * (hp.frac_draft + hp.frac_distill)
    else:
        draft = make_model(hp.draft, tokenizer, vocab)
        log(f"draft: {n_params(draft) / 1e6:.3f}M params")
        t_draft = train_lm(
            "draft",
            draft,
            train_ids,
            vxy,
            hp,
            budget * hp.frac_draft,
            hp.draft_lr,
            hp.draft_batch,
            hp.draft_warmup_frac,
            hp.draft_weight_decay,
            log=log,
        )
        distill_budget = budget * hp.frac_distill
    # the teacher is the model as it will be served (weights rounded to the saved dtype)
    target_as_saved = target.to(getattr(torch, hp.target_save_dtype)).float().eval()
    for p in target_as_saved.parameters():
        p.requires_grad_(False)
    t_distill = train_lm(
        "distill",
        draft,
        train_ids,
        vxy,
        hp,
        distill_budget,
        hp.distill_lr,
        hp.distill_batch,
        hp.distill_warmup_frac,
        hp.draft_weight_decay,
        teacher=target_as_saved,
        ce_weight=hp.distill_ce_weight,
        log=log,
    )
    save_model(draft, tokenizer, os.path.join(args.out, "draft"), hp.draft_save_dtype)
    train_seconds = time.time() - t_start

    training = {
        "hyperparameters": asdict(hp),
        "budget_minutes": args.budget_minutes,
        "moby_dick": args.moby_dick,
        "train_seconds_total": round(train_seconds, 1),
        "phases": {
            k: v
            for k, v in (("target", t_target), ("draft", t_draft), ("distill", t_distill))
            if v is not None
        },
        "resumed_from": previous,
        "params": {"target": n_params(target), "draft": n_params(draft)},
        "corpus": {
            "train_tokens": len(train_ids),
            "val_tokens": len(val_ids),
            "books": AUSTEN_BOOKS + (["mobydick"] if args.moby_dick else []),
        },
        "hardware": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "threads": hp.num_threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "command": " ".join(["python"] + sys.argv),
    }
    with open(os.path.join(args.out, "train_log.txt"), "a" if args.resume else "w") as f:
        f.write("\n".join(log_lines) + "\n")
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump({"training": training}, f, indent=2)

    if not args.no_measure:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import measure_pair

        measure_pair.main(["--dir", args.out])
    log(f"all done in {(time.time() - t_start) / 60:.1f} min")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
