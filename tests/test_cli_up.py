"""``specdec up``: what a user running it by hand meets (found by a review as a new
user): ports already taken, a port moved without the address that reaches it, a
stop signal, a service that dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from specdec import cli

from .stack import free_port_sets, set_args, specdec_command


def test_up_refuses_a_port_moved_without_its_address(capsys):
    """--set orchestrator.port alone left the gateway waiting on the old port for
    five minutes; now up says which key to set, at once."""
    sets = [
        s for s in free_port_sets(gateway=True) if not s.startswith("gateway.orchestrator_address")
    ]
    assert cli.main(["up", *set_args(sets)]) == 1
    err = capsys.readouterr().err
    assert "gateway.orchestrator_address is 127.0.0.1:50050" in err, err


def test_up_refuses_ports_that_are_taken(capsys):
    import socket

    sets = free_port_sets(gateway=True)
    gateway_port = int(next(s for s in sets if s.startswith("gateway.port=")).split("=")[1])
    with socket.socket() as held:
        held.bind(("127.0.0.1", gateway_port))
        assert cli.main(["up", *set_args(sets)]) == 1
    err = capsys.readouterr().err
    assert f"gateway 127.0.0.1:{gateway_port}" in err, err


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "zombie"
        not in Path(f"/proc/{pid}/status").read_text().lower().split("state:")[1].split("\\n")[0]
    )


def _wait_up(up) -> list[int]:
    """Wait (at most 240 s) until ``specdec up`` says it is up; its children."""
    deadline = time.monotonic() + 240
    line = ""
    while "specdec is up" not in line:
        line = up.stdout.readline()
        assert line or up.poll() is None, up.stderr.read()
        assert time.monotonic() < deadline, "up did not come up"
    return _children(up.pid)


def _serving(pids: list[int], role: str) -> int:
    """The one of ``pids`` that runs ``specdec serve ROLE``."""
    want = b"serve\x00" + role.encode()
    return next(pid for pid in pids if want in Path(f"/proc/{pid}/cmdline").read_bytes())


def test_a_stop_signal_stops_every_service_and_a_dead_one_is_named(llama_pair):
    """SIGTERM to `specdec up` (kill, systemd, docker stop) left its four services
    running as orphans; now it stops them as Ctrl-C does. And when a service dies,
    up names it and exits 1 (it exited 0, silently)."""
    draft, target = llama_pair
    sets = free_port_sets(gateway=True) + [f"draft.model={draft}", f"target.model={target}"]
    for ending in ("sigterm", "a service dies"):
        up = specdec_command("up", *set_args(sets))
        try:
            services = _wait_up(up)
            assert len(services) == 4, services
            if ending == "sigterm":
                up.send_signal(signal.SIGTERM)
                assert up.wait(60) == 0
            else:
                os.kill(_serving(services, "target"), signal.SIGKILL)
                assert up.wait(60) == 1
                assert "the target exited" in up.stderr.read()
            time.sleep(0.5)
            assert not [pid for pid in services if _alive(pid)], ending
        finally:
            if up.poll() is None:
                up.kill()
                up.wait(10)


def test_up_with_the_models_in_the_orchestrator_starts_it_and_the_gateway_alone(llama_pair):
    """``orchestrator.local_models``: no draft or target service to start; a dead
    orchestrator is named as such (up's names follow the services it started)."""
    draft, target = llama_pair
    sets = free_port_sets(gateway=True) + [
        f"draft.model={draft}",
        f"target.model={target}",
        "orchestrator.local_models=true",
    ]
    up = specdec_command("up", *set_args(sets))
    try:
        services = _wait_up(up)
        assert len(services) == 2, services
        os.kill(_serving(services, "orchestrator"), signal.SIGKILL)
        assert up.wait(60) == 1
        assert "the orchestrator exited" in up.stderr.read()
        time.sleep(0.5)
        assert not [pid for pid in services if _alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
