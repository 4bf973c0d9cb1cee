"""Chaos under load, short: replicas killed with SIGKILL and restarted while 32
clients generate (``benchmarks/chaos.py`` runs the same for 10 minutes).

Two drafts and two targets behind one orchestrator; a target replica and then a
draft replica are killed mid-load. No request is lost or answered twice, every
greedy output equals its no-fault output, a failure is only ever UNAVAILABLE,
the requests in flight on a killed target complete, a dead draft costs fallback
steps only, and every session is freed at the end.
"""

from __future__ import annotations

import pytest

from benchmarks.chaos import print_report, run_chaos

SECONDS = 45
CLIENTS = 32


@pytest.mark.timeout(600)
def test_replicas_killed_under_load_lose_nothing(tmp_path, llama_pair):
    r = run_chaos(
        tmp_path / "chaos",
        *llama_pair,
        seconds=SECONDS,
        clients=CLIENTS,
        kill_every=(10.0, 15.0),
        victims=["target-0", "draft-1"],
        max_new_tokens=24,
        seed=7,
    )
    print_report(r)
    assert not r["restart_errors"], r["restart_errors"]
    assert r["lost"] == 0, r["lost_detail"]
    assert r["duplicated"] == 0
    assert r["server_counted"] == r["requests"]  # each request seen once by the server
    assert r["greedy_checked"] > 100 and r["greedy_wrong"] == 0
    assert set(r["outcomes"]) <= {"completed", "UNAVAILABLE"}, r["failed_detail"]
    killed = [k["replica"] for k in r["kills"]]
    assert killed[:2] == ["target-0", "draft-1"], killed
    target_kill, draft_kill = r["kills"][:2]
    assert target_kill["in_flight"] >= CLIENTS // 2
    # The killed target's requests moved to the other one: they completed, greedy ones
    # token for token as without the fault.
    assert target_kill["completed"] == target_kill["in_flight"], target_kill
    assert draft_kill["completed"] == draft_kill["in_flight"], draft_kill  # fallback
    assert r["fallback_requests"] > 0
    assert not any(r["leftovers"].values()), r["leftovers"]
