"""Smoke test of the benchmark harness (not a timed test: no speed is asserted).

``python -m benchmarks.run --quick`` on the tiny random pair must write
results.json with the expected sections, results.md with its tables, and the
PNG plots; every other benchmark runs one short round and writes its report (the
delay proxy's own tests: ``tests/test_proxy.py``). They run inside this
process where it may renice itself back (``tests/benchrun.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec.local.stack import pin_process

from .benchrun import REPO, run_benchmark


def test_quick_run_writes_results(tmp_path, llama_pair):
    draft, target = llama_pair
    out = tmp_path / "results"
    ran = run_benchmark(
        "benchmarks.run", "--quick", "--draft", str(draft),
        "--target", str(target), "--out", str(out), "--max-new-tokens", "6",
        # every section but the thread settings (more stacks of the same code, 25 s)
        "--sections", "analysis,hf,services,pinned,head_to_head,inprocess,rtt,concurrency,wire",
    )  # fmt: skip
    assert "criteria:" in ran.stdout

    results = json.loads((out / "results.json").read_text())
    for key in ("machine", "analysis", "hf", "services", "pinned", "inprocess", "rtt",
                "concurrency", "wire", "wire_large_vocab", "derived", "criteria",
                "plots"):  # fmt: skip
        assert key in results, key
    for key in ("cpu_model", "cpu_cores", "torch", "load_average", "load_average_end"):
        assert key in results["machine"], key
    an = results["analysis"]
    assert 0.0 <= an["quality"]["alpha"] <= 1.0 and an["cost"]["c"] > 0

    for section in ("services", "pinned"):
        rows = results[section]
        for t in ("0", "1"):
            for name in (f"plain@{t}", f"seq1@{t}", f"ovl3@{t}", f"adaptive@{t}"):
                row = rows[name]
                assert row["tok_s"] > 0 and row["fallback_steps"] == 0, (section, name)
                ms = row["ms_per_step"]
                assert ms["target_forward"] > 0
                if not name.startswith("adaptive"):  # adaptive may rightly choose plain
                    assert (ms["draft_forward"] > 0) == (not name.startswith("plain")), name
    for t in ("0", "1"):
        for mode in ("plain", "assisted3", "default"):
            assert results["hf"]["shared"][f"{mode}@{t}"]["tok_s"] > 0
            assert results["hf"]["target_core"][f"{mode}@{t}"]["tok_s"] > 0
            assert results["hf"]["shared_packed"][f"{mode}@{t}"]["tok_s"] > 0
            assert results["hf"]["target_core_packed"][f"{mode}@{t}"]["tok_s"] > 0
    assert "packed_linear_min_rows" in an["cost"]
    in_step = an["cost"]["in_step"]  # c and v(g) with each draft step after a target pass
    assert set(in_step["c_step"]) == set(in_step["v_step"]) == {str(g) for g in range(1, 9)}
    assert all(v > 0 for v in in_step["c_step"].values())
    assert len(in_step["draft_step_ms_by_position"]) == 8
    cm = results["derived"]["services"]["1"]["cost_model"]
    assert all(v["bound_in_step"] > 0 for v in cm.values())
    for point in results["rtt"].values():
        assert point["rows"]["adaptive@1"]["tok_s"] > 0
    for row in results["concurrency"].values():
        assert row["plain"]["tok_s"] > 0 and row["adaptive"]["tok_s"] > 0
        assert row["plain"]["sustained_tok_s"] > 0 and row["adaptive"]["sustained_tok_s"] > 0
    wire = results["wire"]["top64"]["rows"]
    assert wire["dense"]["wire_bytes_per_token"] > wire["spec"]["wire_bytes_per_token"] > 0
    # q as the draft's hidden states: a 32-wide draft's codes, fewer bytes than 64 entries
    hidden = results["wire"]["hidden"]["rows"]["spec"]["wire_bytes_per_token"]
    assert 0 < hidden < wire["spec"]["wire_bytes_per_token"]
    large = results["wire_large_vocab"]["rows"]
    assert 0 < large["1 hidden"]["wire_bytes_per_token"] < large["1"]["wire_bytes_per_token"]
    assert all(c["value"] is not None for c in results["criteria"])
    front = results["pinned_front_target"]  # the same stack, its front on the target's core
    assert len(front) == 4 and all(row["tok_s"] > 0 for row in front.values())
    assert {name[:3] for name in front} == {"seq", "ovl"}
    assert any("orchestrator on the target's core" in c["criterion"] for c in results["criteria"])
    # where drafting ahead cannot help (shared cores), adaptive against the best sequential
    assert sum("shared cores: adaptive (drafting ahead in" in c["criterion"]
               for c in results["criteria"]) == 2  # fmt: skip
    h2h = results["head_to_head"]  # transformers and the services in the same rounds
    assert set(h2h) == {"shared", "pinned"}
    assert all(len(v) == 1 and v[0] > 0 for part in h2h.values() for v in part["rates"].values())
    assert {"generate@1", "assisted3@1", "plain@1", "seq3@1"} <= set(h2h["shared"]["rates"])
    assert {"one_plain@1", "one_seq3@1", "one_adaptive@0"} <= set(h2h["shared"]["rates"])
    assert {"assisted3@0", "seq3@0", "ovl3@0"} <= set(h2h["pinned"]["rates"])
    paired = [c for c in results["criteria"] if c["criterion"].endswith("(head to head)")]
    assert len(paired) == 16 and all(len(c["rounds"]) == 1 for c in paired)
    assert sum(c["criterion"].startswith("15, one process") for c in paired) == 6
    over = [c for c in paired if "overhead at gamma 3" in c["criterion"]]  # (quick: gamma 3)
    assert len(over) == 4 and all(not c["higher_is_better"] for c in over)
    assert all(0 < c["value"] < 1000 for c in over)  # ms a step, from the responses' stats

    md = (out / "results.md").read_text()
    assert "References, not goals" in (out / "results.md").read_text()
    assert "| criterion | measured | goal | met | paired rounds |" in md
    assert "share, in step" in md and "c_step(g)" in md
    for heading in ("## Criteria", "## Services sharing the cores", "## Added round-trip",
                    "## Concurrent clients", "## The wire",
                    "## Pinned, the orchestrator and the client on the target's core"):  # fmt: skip
        assert heading in md, heading
    assert results["plots"]
    for name in results["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert name in md


def test_against_compares_with_an_older_checkout_as_separate_machines(tmp_path, llama_pair):
    """``benchmarks.against REV --rtt-ms``: REV's services from a git worktree beside
    this build's, each side pinned, its own orchestrator behind delay proxies, with the
    settings ``--set`` gives (and ``--set-now``, this build's side only), requests
    alternating; the worktree is gone afterwards. (One run for both: each stack costs
    seconds to start.)"""
    draft, target = llama_pair
    before = subprocess.run(
        ["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    run_benchmark(
        "benchmarks.against", "HEAD", "--rtt-ms", "2", "--set", "orchestrator.pipeline=true",
        "orchestrator.pipeline_min_rtt_ms=0", "--set-now", "orchestrator.paced=false",
        "--rounds", "2", "--prompts", "1",
        "--max-new-tokens", "6", "--configs", "ovl4@0", "plain@1-p0.9",
        "--draft", str(draft), "--target", str(target), "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["against"] == "HEAD" and list(result["rows"]) == ["ovl4@0", "plain@1-p0.9"]
    assert result["rtt_ms"] == 2 and "orchestrator.pipeline=true" in result["settings"]
    assert result["settings_now"] == ["orchestrator.paced=false"]
    for row in result["rows"].values():
        assert len(row["ratios"]) == 2 and row["before_tok_s"] > 0 and row["now_tok_s"] > 0
        assert row["now_overhead_ms"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| ovl4@0 |" in md and "+2 ms round trip on every hop" in md
    assert "This build's side only: `orchestrator.paced=false`" in md
    after = subprocess.run(
        ["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert after == before


def test_a_key_an_older_checkout_does_not_know_is_left_out_of_its_config(tmp_path):
    """``benchmarks.against REV`` starts REV's services with the benchmarks' settings;
    a REV from before ``target.plain_torch_threads`` refuses the key as unknown, so
    its stack is started without it (and runs as it did)."""
    from benchmarks.common import knows

    old = tmp_path / "old"
    (old / "specdec").mkdir(parents=True)
    (old / "specdec" / "config.py").write_text("class C:\n    torch_threads: int = 0\n")
    assert knows(None, "plain_torch_threads") and knows(REPO, "plain_torch_threads")
    assert knows(old, "torch_threads") and not knows(old, "plain_torch_threads")


def test_step_math_writes_results(tmp_path):
    run_benchmark(
        "benchmarks.step_math", "--steps", "10", "--wire-top-k", "16", "64",
        "--out", str(tmp_path)
    )  # fmt: skip
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    # per vocabulary: greedy once, then each wire top-k at T=1
    assert [(r["temperature"], r["wire_top_k"]) for r in rows[:3]] == [(0, 16), (1, 16), (1, 64)]
    assert len(rows) == 9 and all(r["draft_us"] > 0 and r["target_us"] > 0 for r in rows)
    # Against a git revision: that revision's sampling module, timed in pairs.
    run_benchmark(
        "benchmarks.step_math", "--steps", "4", "--wire-top-k", "16", "--vocabs", "4096",
        "--against", "HEAD", "--keep-freed-mb", "64", "--top-p", "0.9",
        "--out", str(tmp_path / "against")
    )  # fmt: skip
    result = json.loads((tmp_path / "against" / "results.json").read_text())
    assert result["against"] == "HEAD" and len(result["rows"]) == 2
    assert result["keep_freed_mb"] == 64 and result["top_p"] == 0.9
    assert all(r["draft_us_before"] > 0 and r["target_us_before"] > 0 for r in result["rows"])


def test_sustained_writes_results(tmp_path):
    """``benchmarks.sustained`` on the demo pair, one client and one thread setting:
    every mode streamed tokens inside its window, and the report and plot exist."""
    run_benchmark(
        "benchmarks.sustained", "--clients", "1", "--threads", "1",
        "--warm", "0.2", "--window", "0.5", "--repeats", "1", "--out", str(tmp_path)
    )  # fmt: skip
    median = json.loads((tmp_path / "results.json").read_text())["median"]
    assert set(median["1"]["1"]) == {"plain", "adaptive", "seq4"}
    assert all(v > 0 for v in median["1"]["1"].values())
    assert "| 1 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "sustained.png").stat().st_size > 0


def test_sustained_measures_one_process_beside_the_stack(tmp_path, llama_pair):
    """``--one-process``: the orchestrator with both models in its process runs
    every mode in the same rotation, and the report compares it with the stack."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.sustained", "--draft", str(draft), "--target", str(target),
        "--clients", "2", "--threads", "1", "--warm", "0.2", "--window", "0.5",
        "--repeats", "1", "--one-process", "--out", str(tmp_path)
    )  # fmt: skip
    row = json.loads((tmp_path / "results.json").read_text())["median"]["1"]["2"]
    assert set(row) == {"plain", "adaptive", "seq4"} | {
        f"one process {m}" for m in ("plain", "adaptive", "seq4")
    }
    assert all(v > 0 for v in row.values())
    assert "one process, best mode / the stack's best" in (tmp_path / "results.md").read_text()


def test_relay_side_by_side_writes_results(tmp_path):
    """``benchmarks.relay``'s concurrent part, one client: both routes measured, the
    relaying orchestrator did relay, and the report has the row."""
    run_benchmark(
        "benchmarks.relay", "--no-one-client", "--clients", "1", "--repeats", "1",
        "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["median"]["relay x1"] > 0 and result["median"]["direct x1"] > 0
    assert result["machine"]["relay_outcomes_unproxied"]["relayed"] > 0
    assert "| adaptive, 1 clients, T=1, shared |" in (tmp_path / "results.md").read_text()


def test_placement_writes_results(tmp_path):
    """``benchmarks.placement`` on the demo pair, one round of one prompt: every
    placement of the orchestrator measured, and the report has the row. (In an order
    whose niceness never falls: lowering it needs root.)"""
    run_benchmark(
        "benchmarks.placement", "--rounds", "1", "--configs", "seq2@0", "--prompts", "1",
        "--max-new-tokens", "4", "--out", str(tmp_path),
        "--placements", "draft-nice0", "free", "draft", "target",
    )  # fmt: skip
    rates = json.loads((tmp_path / "results.json").read_text())["rates"]
    assert {place: len(v["seq2@0"]) for place, v in rates.items()} == {
        "draft-nice0": 1, "free": 1, "draft": 1, "target": 1,
    }  # fmt: skip
    assert "| seq2@0 |" in (tmp_path / "results.md").read_text()
    assert "draft / draft-nice0" in (tmp_path / "results.md").read_text()
    assert all(v["seq2@0"][0] > 0 for v in rates.values())
    assert "| seq2@0 |" in (tmp_path / "results.md").read_text()


def test_cold_calls_writes_results(tmp_path, llama_pair):
    """``benchmarks.cold_calls`` on the tiny target, two passes: every call timed cold
    and again, and the report has its rows."""
    _, target = llama_pair
    run_benchmark(
        "benchmarks.cold_calls", "--target", str(target), "--passes", "2",
        "--out", str(tmp_path)
    )  # fmt: skip
    rates = json.loads((tmp_path / "results.json").read_text())["rates"]
    assert rates["cold"].keys() == rates["again"].keys()
    assert all(len(v) == 2 for v in rates["cold"].values())
    assert "| verify_draft, greedy, gamma 4 |" in (tmp_path / "results.md").read_text()


def test_packed_linear_side_by_side_writes_results(tmp_path, llama_pair):
    """``benchmarks.packed_linear`` on the tiny pair, one client, one mode: pass times
    of both ways for both models, both stacks streamed tokens, and the report has them."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.packed_linear", "--draft", str(draft), "--target", str(target),
        "--clients", "1", "--modes", "seq4", "--repeats", "1", "--warm", "0.2",
        "--window", "0.5", "--passes", "2", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["median"]["1 clients, seq4, stock"] > 0
    assert result["median"]["1 clients, seq4, packed"] > 0
    times = result["rates"]["pass_times"]
    assert all(t["stock"] > 0 and t["packed"] > 0 for m in times.values() for t in m.values())
    md = (tmp_path / "results.md").read_text()
    assert "| target | 5x8 |" in md and "| 1 | seq4 |" in md


def test_fused_projections_side_by_side_writes_results(tmp_path, llama_pair):
    """``benchmarks.fused_projections`` on the tiny pair: pass times both ways, the
    three services and one process streamed tokens at one client both ways, the
    services under load, and the report has them."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.fused_projections", "--draft", str(draft), "--target", str(target),
        "--clients", "2", "--repeats", "1", "--warm", "0.2", "--window", "0.5",
        "--passes", "2", "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["median"]["2 clients, seq4, fused"] > 0
    times = result["rates"]["pass_times"]
    assert set(times) == {"target, 1 thread", "target, 2 threads", "draft, 1 thread"}
    assert all(t["unfused"] > 0 and t["fused"] > 0 for m in times.values() for t in m.values())
    for way in ("services", "one"):
        assert result["rates"]["one_client"][f"{way}:fused:seq4@1"]["tok_s"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| one process | seq4@0 |" in md and "| 2 | adaptive |" in md


def test_decode_kernel_side_by_side_writes_results(tmp_path, llama_pair):
    """``benchmarks.decode_kernel`` on the tiny pair: the draft's pass times both ways,
    the three services and one process at one client both ways (the same acceptance),
    the services under load, and the report has them."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.decode_kernel", "--draft", str(draft), "--target", str(target),
        "--clients", "2", "--repeats", "1", "--warm", "0.2", "--window", "0.5",
        "--passes", "2", "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["median"]["2 clients, seq4, kernel"] > 0
    (times,) = result["rates"]["pass_times"].values()
    assert times["1x1"]["kernel"] > 0 and times["1x1"]["torch"] > 0
    for way in ("services", "one"):
        assert result["rates"]["one_client"][f"{way}:kernel:seq4@1"]["tok_s"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| one process | seq4@0 |" in md and "alpha torch / kernel" in md


def test_lean_forward_side_by_side_writes_results(tmp_path, llama_pair):
    """``benchmarks.lean_forward`` on the tiny pair: pass times of both ways for both
    models, both stacks streamed tokens at one client and under load, and the report
    has them."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.lean_forward", "--draft", str(draft), "--target", str(target),
        "--clients", "2", "--repeats", "1", "--warm", "0.2", "--window", "0.5",
        "--passes", "2", "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["median"]["2 clients, seq4, wrapped"] > 0
    assert result["median"]["2 clients, seq4, lean"] > 0
    times = result["rates"]["pass_times"]
    assert all(t["wrapped"] > 0 and t["lean"] > 0 for m in times.values() for t in m.values())
    assert result["rates"]["one_client"]["lean:seq4@1"]["tok_s"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| draft | 5x8 |" in md and "| seq4@0 |" in md and "| 2 | adaptive |" in md


def test_plain_threads_side_by_side_writes_results(tmp_path, llama_pair):
    """``benchmarks.plain_threads`` on the tiny pair: generate() and both stacks at one
    client in every mode, both stacks under load, and the report has them."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.plain_threads", "--draft", str(draft), "--target", str(target),
        "--clients", "2", "--repeats", "1", "--warm", "0.2", "--window", "0.5",
        "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    one = result["rates"]["one_client"]
    assert one["generate()@1"][0] > 0 and one["plain passes 2:adaptive@0"][0] > 0
    assert result["median"]["2 clients, plain, one thread"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| plain | 1 |" in md and "| 2 | adaptive |" in md and "plain / generate()" in md


def test_openmp_spins_side_by_side_writes_results(tmp_path, llama_pair, monkeypatch):
    """``benchmarks.openmp_spins`` on the tiny pair: the spin's CPU reading and both
    stacks at one client in every mode; and the spin count is set for the processes
    an arm starts, and the caller's own setting is back afterwards."""
    from benchmarks.openmp_spins import spin_env

    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    with spin_env("10000"):
        assert os.environ["GOMP_SPINCOUNT"] == "10000"
    with spin_env(None):  # (libgomp's own default, set: unset, the target sets its own)
        assert os.environ["GOMP_SPINCOUNT"] == "300000"
    assert os.environ["GOMP_SPINCOUNT"] == "7"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.openmp_spins", "--draft", str(draft), "--target", str(target),
        "--spins", "10000", "--clients", "--repeats", "1", "--max-new-tokens", "8",
        "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    one = result["rates"]["one_client"]
    assert one["libgomp default:seq4@0"][0] > 0 and one["10,000 spins:plain@1"][0] > 0
    assert set(result["rates"]["idle_spin_ms"]) == {"libgomp default", "10,000 spins"}
    md = (tmp_path / "results.md").read_text()
    assert "| plain | 1 | 10,000 spins |" in md and "What a spin costs" in md


def test_pinning_a_service_pins_every_thread_it_has():
    """Emulating separate machines pins each service's threads, not only its main
    one (gRPC's threads carry every message)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    code = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('up', flush=True); time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) == 4
        core = min(os.sched_getaffinity(0))
        pin_process(proc.pid, {core})
        assert all(os.sched_getaffinity(t) == {core} for t in tids)
    finally:
        proc.kill()
        proc.wait()


def test_adaptive_check_writes_results(tmp_path):
    """``benchmarks.adaptive_check`` on the demo pair, one point, one round: adaptive,
    plain and both kinds of one fixed gamma measured, the held-out ratio reported,
    through an orchestrator set as make bench's RTT section sets its own."""
    run_benchmark(
        "benchmarks.adaptive_check", "--repeats", "1", "--rtts", "0", "--temperatures", "0",
        "--gammas", "2", "--prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    saved = json.loads((tmp_path / "results.json").read_text())
    # the orchestrator set as make bench's RTT section sets its own (run.RTT_SETS)
    assert saved["machine"]["orchestrator_set"] == ["orchestrator.pipeline=true"]
    point = saved["rates"]["+0 ms, T=0"]
    assert set(point["rates"]) == {"adaptive", "plain", "seq2", "ovl2"}
    assert all(v[0] > 0 for v in point["rates"].values())
    assert point["held_out"]["ratio"] > 0 and point["held_out"]["picks"][0] in ("seq2", "ovl2")
    # What the adaptive requests chose, from the orchestrator's metrics.
    chose = point["chose"]["adaptive"]
    assert chose["steps"] > 0 and chose["mean_gamma"] >= 0 and chose["draft_token_ms"] > 0
    assert "| +0 ms, T=0 |" in (tmp_path / "results.md").read_text()
    assert "adaptive mean gamma" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "adaptive_check.png").stat().st_size > 0


def test_pipeline_side_by_side_writes_results(tmp_path):
    """``benchmarks.pipeline`` on the demo pair, one point, one round: pipelined and
    asked-for steps and adaptive with and without pipelines measured and compared."""
    run_benchmark(
        "benchmarks.pipeline", "--repeats", "1", "--rtts", "5", "--temperatures", "1",
        "--gammas", "2", "--prompts", "1", "--max-new-tokens", "12", "--out", str(tmp_path)
    )  # fmt: skip
    point = json.loads((tmp_path / "results.json").read_text())["rates"]["+5 ms, T=1"]
    names = {"plain", "adaptive", "adaptive-pipe", "seq2", "ovl2", "pipe2"}
    assert set(point["rates"]) == names
    assert all(v[0] > 0 for v in point["rates"].values())
    assert "| +5 ms, T=1 | **" in (tmp_path / "results.md").read_text()


def test_draft_position_writes_results(tmp_path):
    run_benchmark(
        "benchmarks.draft_position", "--rounds", "1", "--positions", "5", "--no-large",
        "--against", "HEAD", "--out", str(tmp_path)
    )  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    (modes,) = results.values()
    assert set(modes) == {
        "list (top-1024)", "hidden", "hidden, head run too", "hidden at before"
    }  # fmt: skip
    assert all(m["us"] > 0 for m in modes.values())
    assert "| hidden at HEAD |" in (tmp_path / "results.md").read_text()
    (unpacks,) = json.loads((tmp_path / "results.json").read_text())["unpack"].values()
    assert set(unpacks) == {"list (top-1024)", "hidden", "hidden, head not packed"}


def test_pass_cost_writes_results(tmp_path, llama_pair):
    """``benchmarks.pass_cost`` on the tiny pair: a pass time for every cell of the
    grid, both ways, a fit per model and context, and the report and plot."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.pass_cost", "--draft", str(draft), "--target", str(target),
        "--sessions", "1", "2", "--tokens", "1", "3", "--contexts", "8", "--passes", "2",
        "--cold", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    for role in ("target", "draft"):
        grid = result["models"][role]["grid"]
        assert len(grid) == 4 and all(r["ms"] > 0 and r["one_session_ms"] > 0 for r in grid)
        assert set(result["models"][role]["fit"]["8"]) == {
            "a_ms", "b_ms_per_token", "c_ms_per_session", "line_ms_per_token"
        }  # fmt: skip
    assert "| 8 | 3 | 2 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "pass_cost.png").stat().st_size > 0


def test_guesses_side_by_side_writes_results(tmp_path):
    """``benchmarks.guesses`` on the demo pair, one mode, one round, shared cores: both
    stacks measured, only the one with guesses guessed, and the report has the row."""
    run_benchmark(
        "benchmarks.guesses", "--parts", "shared", "--modes", "gamma 4 ahead@0",
        "--clients", "--repeats", "1", "--prompts", "2", "--max-new-tokens", "24",
        "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["median"]["on gamma 4 ahead@0 shared"] > 0
    assert result["median"]["off gamma 4 ahead@0 shared"] > 0
    guesses = result["machine"]["guesses"]
    assert guesses["on"]["used"] > 0 and guesses["off"] == {"used": 0.0, "unused": 0.0}
    md = (tmp_path / "results.md").read_text()
    assert "| gamma 4 ahead, greedy, shared |" in md and "2 prompts x 24 tokens" in md


def test_guess_rates_writes_results(tmp_path, llama_pair):
    """``benchmarks.guess_rates`` on the tiny pair: every rate is a probability."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.guess_rates", "--draft", str(draft), "--target", str(target),
        "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["greedy"]["steps"] > 0 and result["t1"]["positions"] > 0
    for part in ("greedy", "t1"):
        for key, value in result[part].items():
            if key not in ("steps", "rejections", "positions"):
                assert 0.0 <= value <= 1.0, (part, key, value)


def test_set_pairs_become_config_overrides_for_any_section(tmp_path):
    """``benchmarks.chaos --set``: section.key=value pairs reach the services' config,
    ``target.*`` and ``draft.*`` included (those names are also parameters of the
    functions that write the config)."""
    from benchmarks.common import stack_overrides
    from specdec.local.stack import write_config

    overrides = stack_overrides(
        ["orchestrator.pipeline=true", "target.lookahead_tokens=2", "draft.guesses=0"]
    )
    assert overrides == {
        "orchestrator__pipeline": True,
        "target__lookahead_tokens": 2,
        "draft__guesses": 0,
    }
    _, cfg = write_config(tmp_path, "draft-dir", "target-dir", **overrides)
    assert cfg["orchestrator"]["pipeline"] is True
    assert cfg["target"]["lookahead_tokens"] == 2 and cfg["target"]["model"] == "target-dir"
    assert cfg["draft"]["guesses"] == 0 and cfg["draft"]["model"] == "draft-dir"
    with pytest.raises(SystemExit, match="want section.key=value"):
        stack_overrides(["pipeline=true"])


def test_head_to_head_measures_one_process_beside_the_services(tmp_path, llama_pair):
    """``benchmarks.head_to_head --one-process`` on the tiny pair: the orchestrator
    with both models in its process joins the shared part's rounds, and its ratios
    are in the report."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.head_to_head", "--draft", str(draft), "--target", str(target),
        "--parts", "shared", "--one-process", "--rounds", "1", "--ks", "3", "--gammas", "2",
        "--temperatures", "0", "--prompts", "2", "--max-new-tokens", "8", "--out", str(tmp_path)
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    rates = result["parts"]["shared"]["rates"]
    assert all(rates[k][0] > 0 for k in ("one_plain@0", "one_seq2@0", "one_adaptive@0"))
    md = (tmp_path / "results.md").read_text()
    assert "| 15, one process: best gamma / assisted best k, greedy |" in md
    assert "| one process / three services, best gamma each, greedy |" in md
    assert "2 prompts x 8 tokens" in md


def test_proxy_placement_writes_results(tmp_path):
    """``benchmarks.proxy_placement`` on the demo pair, one round of one prompt: both
    placements at niceness 0 measured, with the proxies' lateness and CPU."""
    run_benchmark(
        "benchmarks.proxy_placement", "--rtt-ms", "2", "--rounds", "1", "--configs",
        "plain@0", "adaptive@0", "--prompts", "1", "--max-new-tokens", "4",
        "--placements", "front-nice0", "free", "--out", str(tmp_path),
    )  # fmt: skip
    data = json.loads((tmp_path / "results.json").read_text())["rates"]
    assert {p: len(v["adaptive@0"]) for p, v in data["rates"].items()} == {
        "front-nice0": 1, "free": 1,
    }  # fmt: skip
    assert all(run["chunks"] > 0 for runs in data["late_ms"].values() for run in runs)
    text = (tmp_path / "results.md").read_text()
    assert "free / front-nice0" in text and "adaptive / plain at T=0" in text
