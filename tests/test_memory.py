"""glibc's malloc settings of the model services (``specdec.runtime.memory``)."""

from __future__ import annotations

import subprocess
import sys

from specdec.config import load_config


def test_keep_freed_sets_glibc_malloc_and_zero_leaves_it():
    # In a process of its own: the settings are the whole process's.
    code = (
        "from specdec.runtime.memory import keep_freed; "
        "print(keep_freed(0), keep_freed(256), keep_freed(64))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "True", "True"]


def test_keep_freed_is_a_model_service_setting():
    cfg = load_config(None, ["target.keep_freed_mb=256"])
    assert cfg.target.keep_freed_mb == 256 and cfg.draft.keep_freed_mb == 0  # opt-in
