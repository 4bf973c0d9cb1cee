"""The tests' local stack: ``specdec.local.stack`` on tiny models built from configs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from specdec.local.stack import Stack, free_port, write_config
from specdec.local.stack import local_stack as _local_stack

from .tiny import build_pair

__all__ = ["Stack", "free_port", "local_stack", "write_config"]


@contextlib.contextmanager
def local_stack(
    tmp_path: Path,
    draft: Path | None = None,
    target: Path | None = None,
    env: dict[str, str] | None = None,
    **overrides,
) -> Iterator[Stack]:
    """A stack on tiny Llama models (or the given model dirs); overrides are
    ``section__key=value`` keyword arguments, e.g. ``orchestrator__gamma=3``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if draft is None or target is None:
        draft, target = build_pair(tmp_path / "models")
    with _local_stack(tmp_path, draft, target, env=env, **overrides) as stack:
        yield stack
