"""The tests' forked services (``specdec.local.forkserver``) behave as the processes
they stand for: a pid of their own, the caller's environment and log, health, and
the exit status ``subprocess.Popen`` would report."""

from __future__ import annotations

import os
import signal
import subprocess
from urllib.request import urlopen

import pytest

from specdec.local import forkserver
from specdec.local.stack import free_port, spawn, stop_local, wait_healthy, write_config


def test_only_what_a_fork_can_stand_for_is_forked(monkeypatch, tmp_path):
    monkeypatch.setenv(forkserver.ENV, "1")
    log = open(tmp_path / "x.log", "ab")  # noqa: SIM115
    try:
        assert forkserver.wanted(None, None) and forkserver.wanted(None, subprocess.DEVNULL)
        assert forkserver.wanted(None, log)
        # a planted sitecustomize (only PYTHONPATH differs), but no other environment
        assert forkserver.wanted(dict(os.environ, PYTHONPATH="planted"), None)
        assert not forkserver.wanted(dict(os.environ, OMP_NUM_THREADS="7"), None)
        assert not forkserver.wanted({"PYTHONPATH": "planted"}, None)
        assert not forkserver.wanted(None, subprocess.PIPE)
        monkeypatch.setenv(forkserver.ENV, "0")
        assert not forkserver.wanted(None, None)
    finally:
        log.close()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_forked_service_serves_logs_and_exits_as_a_process(
    monkeypatch, tmp_path, llama_pair, sig, code
):
    monkeypatch.setenv(forkserver.ENV, "1")
    forkserver.start()
    path, cfg = write_config(tmp_path, *llama_pair)
    metrics_port = free_port()  # set in the caller's environment after the template started
    monkeypatch.setenv("SPECDEC_DRAFT_METRICS_PORT", str(metrics_port))
    monkeypatch.chdir(tmp_path)  # a log named relative to here; the service runs elsewhere
    log = open("draft.log", "ab")  # noqa: SIM115
    proc = spawn("draft", str(path), ["draft.keep_freed_mb=64"], log)  # (glibc's malloc set)
    try:
        assert isinstance(proc, forkserver.ForkedProcess)
        assert proc.pid != os.getpid() and proc.poll() is None
        wait_healthy(f"127.0.0.1:{cfg['draft']['port']}", 120, [proc])
        with urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"specdec_model_live_sessions" in r.read()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        proc.send_signal(sig)
        assert proc.wait(30) == code and proc.returncode == code
        proc.send_signal(signal.SIGTERM)  # gone: nothing is signalled
    finally:
        stop_local([proc])
        log.close()
    text = (tmp_path / "draft.log").read_text()
    assert f"draft serving on 127.0.0.1:{cfg['draft']['port']}" in text


def test_a_forked_service_runs_a_planted_sitecustomize(monkeypatch, tmp_path, llama_pair):
    """As a fresh interpreter would at start: a test's fault planted as
    ``sitecustomize`` on PYTHONPATH runs in the forked service, before it serves."""
    monkeypatch.setenv(forkserver.ENV, "1")
    site = tmp_path / "site"
    site.mkdir()
    mark = tmp_path / "planted"
    (site / "sitecustomize.py").write_text(
        f"import os, specdec.cli\nopen({str(mark)!r}, 'w').write(str(os.getpid()))\n"
    )
    path, cfg = write_config(tmp_path, *llama_pair)
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = spawn("draft", str(path), [], subprocess.DEVNULL, env)
    try:
        assert isinstance(proc, forkserver.ForkedProcess)
        wait_healthy(f"127.0.0.1:{cfg['draft']['port']}", 120, [proc])
        assert mark.read_text() == str(proc.pid)
    finally:
        stop_local([proc])
