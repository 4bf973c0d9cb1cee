"""The tests' local stack: ``specdec.local.stack`` on tiny models built from configs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from specdec.config import REPO_ROOT
from specdec.local.forkserver import ENV as FORKSERVER
from specdec.local.proxy import FaultProxy
from specdec.local.stack import Stack, free_port, write_config
from specdec.local.stack import local_stack as _local_stack

from .tiny import build_pair

__all__ = [
    "Stack",
    "drafted_on",
    "free_port",
    "free_port_sets",
    "local_stack",
    "planted_env",
    "proxied_stack",
    "set_args",
    "specdec_command",
    "write_config",
]


def free_port_sets(gateway: bool = False) -> list[str]:
    """``section.key=value`` settings that move the default config's services (and the
    gateway, with ``gateway``) and their metrics to free ports, every address that
    reaches one of them moved with it (as ``specdec demo`` and ``up`` take them)."""
    roles = ("draft", "target", "orchestrator", *(("gateway",) if gateway else ()))
    ports = {role: free_port() for role in roles}
    sets = [f"{role}.port={port}" for role, port in ports.items()]
    sets += [f"{role}.metrics_port={free_port()}" for role in roles]
    sets += [f"orchestrator.{role}_address=127.0.0.1:{ports[role]}" for role in ("draft", "target")]
    if gateway:
        sets.append(f"gateway.orchestrator_address=127.0.0.1:{ports['orchestrator']}")
    return sets


def set_args(sets: list[str]) -> list[str]:
    """Command-line arguments: ``--set`` before each setting."""
    return [arg for s in sets for arg in ("--set", s)]


def specdec_command(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m specdec ARGS`` from the repository's root, as a user runs it: each
    service it starts a fresh interpreter (not forked from the tests' template), its
    output piped as text. ``env``: more environment variables."""
    return subprocess.Popen(
        [sys.executable, "-m", "specdec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, FORKSERVER: "0", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def drafted_on(stack: Stack, outcome: str) -> float:
    """The draft's head starts so far with this outcome (used, discarded, skipped)."""
    return stack.metric("draft", "specdec_model_drafted_on_total", f'outcome="{outcome}"')


def guesses_used(stack: Stack) -> float:
    """The draft's guesses so far that answered their propose (``draft.guesses``)."""
    return stack.metric("draft", "specdec_model_draft_guesses_total", 'outcome="used"')


def planted_env(tmp_path: Path, source: str) -> dict[str, str]:
    """An environment whose Python processes run ``source`` at start-up (as
    ``sitecustomize``): how a test plants a fault in the services it starts."""
    site = tmp_path / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(source)
    repo = Path(__file__).resolve().parent.parent
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(repo)]))


@contextlib.contextmanager
def local_stack(
    tmp_path: Path,
    draft: Path | None = None,
    target: Path | None = None,
    env: dict[str, str] | None = None,
    **overrides,
) -> Iterator[Stack]:
    """A stack on tiny Llama models (or the given model dirs); overrides are
    ``section__key=value`` keyword arguments, e.g. ``orchestrator__gamma=3``.

    Unless a test sets them, the draft's call deadline and the relay's send
    deadline are long: on a loaded CI machine one slow call past the production
    deadlines (0.5 s, 0.1 s) makes a step fall back or re-seed its verify, and
    tests comparing sampled output across routes or against the theory would
    fail on the machine's speed, not on the code. Tests of those deadlines set
    their own."""
    overrides.setdefault("orchestrator__draft_timeout_s", 30.0)
    overrides.setdefault("draft__relay_send_timeout_s", 5.0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if draft is None or target is None:
        draft, target = build_pair(tmp_path / "models")
    with _local_stack(tmp_path, draft, target, env=env, **overrides) as stack:
        yield stack


@contextlib.contextmanager
def proxied_stack(
    tmp_path: Path, draft: Path, target: Path, **overrides
) -> Iterator[tuple[Stack, FaultProxy, FaultProxy]]:
    """A stack whose orchestrator reaches the draft and the target through fault
    proxies (``specdec.local.proxy``); a draft's relays take the target's proxy too.
    Yields (stack, draft proxy, target proxy)."""
    draft_port, target_port = free_port(), free_port()
    with (
        FaultProxy("127.0.0.1", draft_port) as draft_proxy,
        FaultProxy("127.0.0.1", target_port) as target_proxy,
        local_stack(
            tmp_path,
            draft,
            target,
            draft__port=draft_port,
            target__port=target_port,
            orchestrator__draft_address=draft_proxy.address,
            orchestrator__target_address=target_proxy.address,
            **overrides,
        ) as stack,
    ):
        yield stack, draft_proxy, target_proxy
