"""Tests touch only what they start.

No recipe, test or benchmark stops processes by name (``pkill``, ``killall``): on a
shared machine that kills other people's work, and a user's own Prometheus. Our
tests start their own Prometheus on a free port, with its own data directory, and
stop exactly that process by its id; this checks it against a Prometheus they did
not start.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from specdec.local.stack import free_port

from .test_observability import PrometheusServer, _tool

REPO = Path(__file__).resolve().parent.parent
KILL_BY_NAME = re.compile(r"\b(pkill|killall)\b|pgrep[^\n]*\|\s*xargs\s+kill")


def test_make_test_kills_nothing_by_name():
    make = shutil.which("make")
    assert make, "make is needed to run the tests the way CI does"
    plan = subprocess.run(
        [make, "-n", "test", "system-deps"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert plan.returncode == 0, plan.stderr
    assert "pytest" in plan.stdout  # the dry run did show the recipes
    assert not KILL_BY_NAME.search(plan.stdout), plan.stdout


def test_no_script_kills_by_name():
    files = [REPO / "Makefile", *(REPO / ".ci").glob("*")]
    for folder in ("tests", "benchmarks", "specdec", "deploy"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh", ".yaml")]
    hits = [
        f"{p.relative_to(REPO)}: {m.group(0)}"
        for p in files
        if p.is_file() and p != Path(__file__).resolve()
        for m in [KILL_BY_NAME.search(p.read_text(errors="replace"))]
        if m
    ]
    assert not hits, hits


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture
def users_prometheus(tmp_path):
    """A Prometheus the tests did not start, as a user's would be: its own port, data dir."""
    binary = _tool("prometheus")
    port = free_port()
    config = tmp_path / "users.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}}))
    with open(tmp_path / "users.log", "w") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'users-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert proc.poll() is None, (tmp_path / "users.log").read_text()
            assert time.monotonic() < deadline, "the user's Prometheus did not start"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:  # ours to stop: this test started it
            proc.terminate()
            proc.wait(30)


def test_a_prometheus_the_tests_did_not_start_keeps_running(users_prometheus, tmp_path):
    proc, url = users_prometheus
    # What `make test` runs before pytest (it used to stop every Prometheus by name:
    # never run it if it would still do that).
    make = shutil.which("make") or "make"
    plan = subprocess.run([make, "-n", "system-deps"], cwd=REPO, capture_output=True, text=True)
    assert not KILL_BY_NAME.search(plan.stdout), plan.stdout
    subprocess.run([make, "system-deps"], cwd=REPO, check=True, timeout=600)
    # The observability tests' Prometheus lifecycle, twice: start on a free port, stop.
    for round_ in range(2):
        ours = PrometheusServer(_tool("prometheus"), tmp_path / f"ours-{round_}", {})
        assert ours.port != int(url.rsplit(":", 1)[1])
        assert _ready(ours.url)
        ours.stop()
        assert ours.proc.poll() is not None
    assert proc.poll() is None, "the user's Prometheus was stopped"
    assert _ready(url)
