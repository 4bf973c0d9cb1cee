"""``specdec demo``: what the product is for: the same text, faster.

Starts draft, target and orchestrator locally (``configs/default.yaml``: the
bundled demo pair), then, through those same services:

1. a side-by-side for one greedy prompt: plain decoding (gamma 0) against
   speculative decoding (the server's default gamma). Both texts, whether they
   are identical (they must be: greedy speculative output is the target's own
   greedy output), tokens/s of each and the speedup, the acceptance rate, and
   the formula's tokens per step next to the measured ones;
2. a few sampled completions with their statistics.

The services' output goes to log files in a temporary folder, named only if
something fails. Not for: benchmarking (``make bench`` measures a gamma sweep,
the cost ratio c and more, on many prompts).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from specdec.config import Config, load_config
from specdec.local.stack import ROLES, service_roles, start_local, stop_local
from specdec.sampling import expected_tokens_per_step

# The greedy prompt and length: chosen because the demo pair's greedy text for
# them does not fall into a loop (models/demo/MODEL_CARD.md, "The demo's prompt").
GREEDY_PROMPT = "Mrs. Jennings was a widow with an ample jointure."
GREEDY_TOKENS = 48  # ends at a full stop; the next sentence is a loop
SAMPLED_PROMPTS = ("Mr. Darcy looked at Elizabeth and", "The morning was fine, and Emma")
SAMPLED_TEMPERATURE, SAMPLED_SEED = 0.8, 1
REPEATS = 3  # timed runs of each mode, interleaved, after one warm-up of each
TIMEOUT_S = 120.0


@dataclass
class Run:
    """One greedy Generate: its output and the orchestrator's statistics."""

    token_ids: list[int]
    text: str
    stats: object  # specdec.v1.GenerationStats


# ---- talking to the orchestrator ------------------------------------------------------
def greedy_run(stub, prompt: str, max_new_tokens: int, gamma: int) -> Run:
    """One greedy request with this gamma, steps one after the other (no drafting
    ahead: the seed's formula describes exactly this)."""
    from specdec.v1 import orchestrator_pb2

    request = orchestrator_pb2.GenerateRequest(
        text=prompt, max_new_tokens=max_new_tokens, temperature=0.0, gamma=gamma, overlap=False
    )
    ids: list[int] = []
    text, stats = "", None
    for message in stub.Generate(request, timeout=TIMEOUT_S):
        if message.HasField("chunk"):
            ids += message.chunk.token_ids
            text += message.chunk.text
        else:
            stats = message.stats
    return Run(ids, text, stats)


def measure(stub, prompt: str, max_new_tokens: int, repeats: int) -> dict[str, list[Run]]:
    """Each mode once to warm up (untimed), then ``repeats`` times, interleaved and
    alternating which goes first, so that a change in the machine's load hits both.
    Speculative decoding uses the server's configured gamma."""
    from specdec.v1 import orchestrator_pb2

    default = stub.Info(orchestrator_pb2.OrchestratorInfoRequest(), timeout=TIMEOUT_S)
    modes = {"plain": 0, "speculative": default.default_gamma}
    for gamma in modes.values():
        greedy_run(stub, prompt, max_new_tokens, gamma)
    runs: dict[str, list[Run]] = {name: [] for name in modes}
    for r in range(repeats):
        for name in list(modes)[:: 1 if r % 2 == 0 else -1]:
            runs[name].append(greedy_run(stub, prompt, max_new_tokens, modes[name]))
    return runs


def report_texts(runs: dict[str, list[Run]], out: TextIO) -> bool:
    """Both texts and whether every run of both modes gave the same tokens."""
    plain, spec = runs["plain"][0], runs["speculative"][0]
    identical = all(r.token_ids == plain.token_ids for rs in runs.values() for r in rs)
    out.write(f"\nplain decoding (gamma 0):\n{_wrap(plain.text)}\n")
    out.write(f"speculative decoding (gamma {spec.stats.gamma}):\n{_wrap(spec.text)}\n")
    verdict = "yes (token for token, in every run)" if identical else "NO (this is a bug)"
    out.write(f"\nidentical: {verdict}\n")
    return identical


def report_speed(runs: dict[str, list[Run]], max_new_tokens: int, out: TextIO) -> None:
    """tokens/s of each (median), the speedup, acceptance, and tokens per step against
    the formula."""
    w = out.write
    tok_s = {n: [r.stats.tokens_per_second for r in rs] for n, rs in runs.items()}
    median = {n: statistics.median(v) for n, v in tok_s.items()}
    w(f"\n  {'':<12} {'tokens/s':>9} {'(range)':>13} {'steps':>6} {'tokens/step':>12}\n")
    for name, rs in runs.items():
        s, spread = rs[0].stats, f"({min(tok_s[name]):.1f}-{max(tok_s[name]):.1f})"
        w(f"  {name:<12} {median[name]:>9.1f} {spread:>13} {s.steps:>6} ")
        w(f"{s.generated_tokens / s.steps:>12.2f}\n")
    w(f"speedup: {median['speculative'] / median['plain']:.2f}x\n")
    if any(max(v) > 1.5 * min(v) for v in tok_s.values()):
        w("  (runs of the same request differed by more than 1.5x: this machine is busy,\n")
        w("  so the speedup is noise as much as signal; run the demo again when it is idle)\n")

    spec = runs["speculative"][0]
    s, gamma = spec.stats, spec.stats.gamma
    w(f"acceptance rate: {s.acceptance_rate:.2f} ")
    w(f"({s.accepted_tokens} of {s.drafted_tokens} drafted tokens accepted)\n")
    if s.judged_tokens and not s.fallback_steps:
        a = s.accepted_tokens / s.judged_tokens
        w(
            f"tokens per step: measured {s.generated_tokens / s.steps:.2f}; theory "
            f"(1 - a^{gamma + 1}) / (1 - a) = {expected_tokens_per_step(a, gamma):.2f} "
            f"with a = {a:.2f},\n  the acceptance of a judged draft ({s.accepted_tokens} of "
            f"{s.judged_tokens} accepted: a step stops judging at its\n  first rejection, while "
            "the acceptance rate above counts every drafted token)\n"
        )


def side_by_side(
    stub,
    prompt: str,
    max_new_tokens: int,
    repeats: int,
    out: TextIO,
    where: str = "all three services share",
) -> bool:
    """Plain against speculative decoding on one greedy prompt; True if identical.
    ``where``: what runs on this machine's cores, for the report's last line."""
    out.write(f"\n== Same text, faster: greedy, {max_new_tokens} new tokens ==\n")
    out.write(f"prompt: {prompt}\n")
    out.flush()
    load = os.getloadavg()[0]
    runs = measure(stub, prompt, max_new_tokens, repeats)
    identical = report_texts(runs, out)
    report_speed(runs, max_new_tokens, out)
    out.write(
        f"measured: one warm-up request of each, then {repeats} interleaved "
        f"run{'s' if repeats > 1 else ''} of each;\n"
        "  tokens/s = median over the runs of generated tokens / request time at the\n"
        f"  orchestrator (prefill included); {where} this machine's\n"
        f"  {os.cpu_count()} CPU cores (load average {load:.1f} before the runs)\n"
    )
    return identical


def sampled(address: str, max_new_tokens: int, out: TextIO) -> int:
    """The sampled completions, streamed, with their statistics (``specdec generate``)."""
    from specdec import cli

    out.write(f"\n== Sampled: temperature {SAMPLED_TEMPERATURE}, seed {SAMPLED_SEED} ==\n")
    rc = 0
    for prompt in SAMPLED_PROMPTS:
        out.write("\n")
        args = cli.build_parser().parse_args(
            ["generate", prompt, "--max-new-tokens", str(max_new_tokens)]
            + ["--temperature", str(SAMPLED_TEMPERATURE), "--seed", str(SAMPLED_SEED)]
            + ["--address", address]
        )
        rc = rc or cli.generate(args, out)
    return rc


def _wrap(text: str) -> str:
    """The text on indented lines (its own line breaks shown as spaces)."""
    return textwrap.fill(" ".join(text.split()), 96, initial_indent="  ", subsequent_indent="  ")


# ---- starting and stopping ------------------------------------------------------------
def busy_ports(cfg: Config, gateway: bool = False) -> list[str]:
    """The configured listen addresses that something else already holds (the
    gateway's too, with ``gateway``)."""
    busy = []
    roles = service_roles(cfg.orchestrator.local_models)
    for role in (*roles, "gateway") if gateway else roles:
        section = getattr(cfg, role)
        for port in (section.port, section.metrics_port):
            if not port:
                continue
            with socket.socket() as s:
                # As the services bind: a port that only closed connections linger on
                # (TIME_WAIT, after a run just stopped) is free to them.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((section.host, port))
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:  # anything else: the service will say
                        busy.append(f"{role} {section.host}:{port}")
    return busy


class Progress:
    """One line per service while it starts: 'starting draft ... ready (3.1 s)'."""

    def __init__(self, out: TextIO, roles: tuple[str, ...] = ROLES) -> None:
        """``roles``: the services started, in order (``service_roles``)."""
        self.out, self.t0, self.roles = out, time.monotonic(), roles
        self._starting(roles[0])

    def _starting(self, role: str) -> None:
        self.out.write(f"starting {role} ...")
        self.out.flush()

    def __call__(self, role: str) -> None:  # start_local's on_ready
        self.out.write(f" ready ({time.monotonic() - self.t0:.1f} s)\n")
        i = self.roles.index(role) + 1
        if i < len(self.roles):
            self._starting(self.roles[i])
        self.out.flush()


def _report_logs(log_dir: Path, out: TextIO, lines: int = 8) -> None:
    out.write(f"\nservice logs: {log_dir}\n")
    for role in ROLES:
        log = log_dir / f"{role}.log"
        if log.exists() and log.stat().st_size:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.write(f"--- {log.name} (last lines) ---\n" + "\n".join(tail) + "\n")


def run_demo(
    config_path: str | None,
    overrides: list[str],
    max_new_tokens: int | None = None,
    repeats: int | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Start the services, show the side-by-side and the sampled completions, stop."""
    from specdec.v1 import orchestrator_pb2_grpc

    max_new_tokens = max_new_tokens or GREEDY_TOKENS
    repeats = repeats or REPEATS
    cfg = load_config(config_path, overrides)
    busy = busy_ports(cfg)
    if busy:
        out.write(
            f"error: already in use: {', '.join(busy)} (another specdec?); choose free ports "
            "with --set, e.g. --set orchestrator.port=PORT\n"
        )
        return 1
    out.write(f"specdec demo: draft {cfg.draft.model}, target {cfg.target.model}\n")
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-demo-"))
    ok, error, interrupted = False, "", False
    try:
        progress = Progress(out, service_roles(cfg.orchestrator.local_models))
        procs = start_local(config_path, overrides, log_dir=log_dir, on_ready=progress)
        try:
            o = cfg.orchestrator
            address = f"{o.host}:{o.port}"
            out.write(f"ready: orchestrator on {address}\n")
            with grpc.insecure_channel(address) as channel:
                stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
                where = "all three services share"
                if cfg.orchestrator.local_models:
                    where = "both models, in one process, share"
                identical = side_by_side(stub, GREEDY_PROMPT, max_new_tokens, repeats, out, where)
            rc = sampled(address, max_new_tokens, out)
            ok = identical and rc == 0
        finally:
            stop_local(procs)
    except grpc.RpcError as e:
        error = f"{e.code().name}: {e.details()}"
    except RuntimeError as e:
        error = str(e)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if ok or interrupted:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:  # the logs first: the harness's errors point "above" to a service's output
            _report_logs(log_dir, out)
        if error:
            out.write(f"error: {error}\n")
        out.flush()
    return 0 if ok else 1
