"""``specdec demo``: the side-by-side on the bundled demo pair (the same text,
and a speedup figure), its quiet output, its log files when a service fails,
and the estimate of alpha it puts into (1 - alpha^(gamma+1)) / (1 - alpha)."""

from __future__ import annotations

import io
import re
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from specdec.demo import run_demo
from specdec.sampling import expected_tokens_per_step

from .stack import free_port_sets, set_args, specdec_command

ROLES = ("draft", "target", "orchestrator")


def run_command(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[int, str, str]:
    """``specdec demo`` on free ports; (exit status, stdout, stderr)."""
    # TMPDIR: the demo's log folder lands under tmp_path, where the test can look. Its
    # services start as a user's do, each a fresh interpreter (not forked with their
    # imports done, as the other tests' are: tests/conftest.py).
    proc = specdec_command(
        "demo", *set_args(free_port_sets()), *args, env={"TMPDIR": str(tmp_path)}
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo stops its services on the way out
        out, err = proc.communicate(timeout=50)
        pytest.fail(f"specdec demo ran over {timeout:.0f} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


# ---- the command, end to end ----------------------------------------------------------------
def test_demo_shows_the_same_text_and_a_speedup(tmp_path):
    # The demo's own prompt and length; one timed run of each mode keeps it short.
    rc, out, err = run_command(tmp_path, "--repeats", "1")
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "identical: yes" in out
    # The greedy text does not loop: no run of 2-8 words said twice in a row
    # ("the most agreeable, the most agreeable"; "I am sure I am sure").
    text = out.split("plain decoding (gamma 0):\n", 1)[1].split("\nspeculative decoding", 1)[0]
    assert len(text.split()) > 30
    assert not re.search(r"\b(\w+(?: \w+){1,7}),? \1\b", " ".join(text.split())), text
    assert re.search(r"^speedup: \d+\.\d\dx$", out, re.M), out
    # Plain decoding draws runs of 1, 2, 4, 8, 8, ... tokens (plain_run_tokens); speculation
    # is next to the formula.
    assert re.search(r"^  plain +[\d.]+ +\([\d.]+-[\d.]+\) +9 +5\.33$", out, re.M), out
    m = re.search(r"tokens per step: measured ([\d.]+); theory .*? = ([\d.]+) with a", out)
    assert m and float(m[1]) > 1.5 and float(m[2]) > 1.5, out
    assert out.count("[48 tokens in") == 2  # the two sampled completions
    # Quiet: a progress line per service, none of the services' own output.
    for role in ROLES:
        assert re.search(rf"^starting {role} \.\.\. ready \(\d+\.\d s\)$", out, re.M), out
    for noise in ("Loading weights", " INFO ", "WARNING"):
        assert noise not in out + err
    assert not list(tmp_path.glob("specdec-demo-*")), "logs of a successful demo are removed"


def test_demo_in_one_process_starts_the_orchestrator_alone(tmp_path):
    """``orchestrator.local_models``: one progress line, the same text, and the
    report says what shares the cores."""
    rc, out, err = run_command(
        tmp_path, "--repeats", "1", "--max-new-tokens", "16", "--set",
        "orchestrator.local_models=true",
    )  # fmt: skip
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "identical: yes" in out
    assert re.findall(r"^starting (\w+) \.\.\. ready", out, re.M) == ["orchestrator"], out
    assert "both models, in one process, share this machine's" in out
    assert "0 wire B/token" in out


def test_demo_names_its_logs_when_a_service_fails(tmp_path, monkeypatch):
    """In this process (the command itself runs in the test above): the services fork."""
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the log folder lands here
    text = io.StringIO()
    sets = free_port_sets() + [f"draft.model={not_a_model}"]
    rc = run_demo(None, sets, out=text)
    out = text.getvalue()
    assert rc == 1
    m = re.search(r"^service logs: (\S+)$", out, re.M)
    assert m, out
    logs = Path(m[1])
    assert logs.parent == tmp_path and (logs / "draft.log").stat().st_size > 0
    assert "--- draft.log (last lines) ---" in out
    assert "error: a service exited during start-up" in out


def test_demo_refuses_a_port_that_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = io.StringIO()
        rc = run_demo(None, [f"orchestrator.port={port}"], out=out)
    assert rc == 1
    assert f"already in use: orchestrator 127.0.0.1:{port}" in out.getvalue()
    assert "starting" not in out.getvalue()


# ---- alpha from the steps ---------------------------------------------------------------
def simulated_steps(alpha: float, gamma: int, max_new_tokens: int, seed: int) -> list[int]:
    """Tokens emitted by each step when every draft is accepted with chance alpha."""
    rng = np.random.default_rng(seed)
    sizes: list[int] = []
    while (emitted := sum(sizes)) < max_new_tokens:
        drafted = min(gamma, max_new_tokens - emitted - 1)
        n = 0
        while n < drafted and rng.random() < alpha:
            n += 1
        sizes.append(n + 1)
    return sizes


def test_formula_with_judged_acceptance_predicts_tokens_per_step():
    # i.i.d. acceptance, alpha 0.7, gamma 4, ~4000 steps: the estimate is within 0.015
    # of alpha (about 3.5 standard errors), and the formula with it within 2% of the
    # measured tokens per step. The statistics' acceptance_rate (accepted / drafted)
    # put into the same formula must miss by far more: it is not alpha.
    alpha, gamma, tokens = 0.7, 4, 12_000
    sizes = simulated_steps(alpha, gamma, tokens, seed=16)
    # As the orchestrator counts them (GenerationStats.judged_tokens): a step
    # judges its drafts in order and stops at the first rejection.
    accepted = judged = emitted = 0
    for size in sizes:
        drafted, n = min(gamma, tokens - emitted - 1), size - 1
        accepted, judged, emitted = accepted + n, judged + n + (n < drafted), emitted + size
    measured = tokens / len(sizes)
    a = accepted / judged
    assert abs(a - alpha) < 0.015
    assert abs(expected_tokens_per_step(a, gamma) / measured - 1) < 0.02
    emitted_before = np.cumsum([0, *sizes[:-1]])
    rate = accepted / np.minimum(gamma, tokens - emitted_before - 1).sum()
    assert abs(expected_tokens_per_step(rate, gamma) / measured - 1) > 0.2
