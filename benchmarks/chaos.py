"""Chaos under load: kill -9 and restart replicas while many clients generate.

    python -m benchmarks.chaos [--minutes 10] [--clients 32] [--kill-every 20 40]
                               [--draft DIR --target DIR] [--set section.key=value ...]
                               [--out results/chaos-<stamp>]

Two draft and two target replicas (a static address list each) serve one
orchestrator; ``--clients`` threads send Generate requests without pause, greedy
(three in four, each checked token for token against its no-fault output) and
sampled, with gamma 0-6 or unset (adaptive: the orchestrator chooses it). Every
``--kill-every`` seconds (uniform in the range) a random replica is killed with
SIGKILL and started again on its port. ``--set`` runs the services with other
settings (``--set orchestrator.pipeline=true``: pipelines, which run at light
load, so with few ``--clients``). The promises under test
(docs/reliability.md): a request whose target replica dies moves to the other
replica (re-prefilled from its history, same greedy output) or fails with
UNAVAILABLE if there is none; a dead draft means fallback steps (exact), never a
failed request; no request is lost or answered twice; memory stays flat.

Prints a summary and writes chaos.json and chaos.png into the output folder. A
program, not a timed test; ``tests/test_chaos.py`` runs a short version of it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import yaml

from specdec.local.stack import free_port, spawn, stop_local, wait_healthy, write_config
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    REPO,
    machine_info,
    scrape,
    stack_overrides,
)

REPLICAS = ("draft-0", "draft-1", "target-0", "target-1")
GREEDY_SHARE = 0.75
REQUEST_TIMEOUT_S = 60.0
RSS_EVERY_S = 2.0


# ---- the cluster -----------------------------------------------------------------------------
class Cluster:
    """Two drafts, two targets and an orchestrator as child processes on loopback.

    Each process is ours: killed or stopped by its own process id, never by name.
    """

    def __init__(self, folder: Path, draft: Path, target: Path, **overrides) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.log_dir = folder / "logs"
        self.log_dir.mkdir(exist_ok=True)
        self.path, self.cfg = write_config(folder, draft, target, **overrides)
        self.sets: dict[str, list[str]] = {}
        self.ports: dict[str, tuple[int, int]] = {}  # name -> (port, metrics port)
        for name in REPLICAS:
            role = name.split("-")[0]
            port, mport = free_port(), free_port()
            self.ports[name] = (port, mport)
            self.sets[name] = [f"{role}.port={port}", f"{role}.metrics_port={mport}"]
        for role in ("draft", "target"):
            self.cfg["orchestrator"][f"{role}_address"] = ",".join(
                f"127.0.0.1:{self.ports[n][0]}" for n in REPLICAS if n.startswith(role)
            )
        o = self.cfg["orchestrator"]
        self.ports["orchestrator"] = (o["port"], o["metrics_port"])
        self.sets["orchestrator"] = []
        self.path.write_text(yaml.safe_dump(self.cfg))
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['orchestrator'][0]}"

    def _spawn(self, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = spawn(name.split("-")[0], str(self.path), self.sets[name], log)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        try:
            for name in REPLICAS:
                self._spawn(name)
            for name in REPLICAS:
                wait_healthy(f"127.0.0.1:{self.ports[name][0]}", 300, list(self.procs.values()))
            self._spawn("orchestrator")
            wait_healthy(self.address, 300, list(self.procs.values()))
        except BaseException:
            self.stop()
            raise

    def kill(self, name: str) -> None:
        """SIGKILL one replica (no drain, no goodbye) and reap it."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def restart(self, name: str) -> None:
        """Start ``name`` again on its port; returns once it is healthy."""
        proc = self._spawn(name)
        wait_healthy(f"127.0.0.1:{self.ports[name][0]}", 300, [proc])

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items() if p.poll() is None}

    def metric(self, name: str, metric: str) -> float:
        """Sum of a metric's samples at one process."""
        return sum(v for (n, _), v in scrape(self.ports[name][1]).items() if n == metric)

    def stop(self) -> None:
        stop_local(list(self.procs.values()))


# ---- the clients -----------------------------------------------------------------------------
@dataclass
class Outcome:
    """One request, as its client saw it."""

    rid: int
    start: float  # seconds since the load began
    end: float
    greedy: bool
    prompt: int
    max_new_tokens: int
    kind: str  # "completed", a status code name, or "lost: <why>"
    tokens: int = 0
    fallback_steps: int = 0
    wrong: bool = False  # greedy output differs from the no-fault output
    duplicated: bool = False  # more tokens streamed than counted, or than asked for
    detail: str = ""
    ids: list[int] = field(default_factory=list, repr=False)


def generate(stub, request, deadline_s: float = REQUEST_TIMEOUT_S) -> tuple[list[int], object]:
    ids, stats = [], None
    for msg in stub.Generate(request, timeout=deadline_s):
        if msg.HasField("chunk"):
            ids += msg.chunk.token_ids
        elif stats is None:
            stats = msg.stats
        else:
            raise AssertionError("a second statistics message")
    return ids, stats


class Load:
    """``clients`` threads sending requests back to back until ``stop_at``."""

    def __init__(
        self,
        address: str,
        clients: int,
        prompts: list[str],
        references: dict,
        max_new_tokens: int,
        seed: int,
    ) -> None:
        self.address = address
        self.max_new_tokens = max_new_tokens
        self.clients = clients
        self.prompts = prompts
        self.references = references  # prompt index -> greedy ids (no faults)
        self.seed = seed
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.next_rid = 0
        self.t0 = 0.0
        self.threads: list[threading.Thread] = []

    def start(self, stop_at: float) -> None:
        self.t0 = time.monotonic()
        self.threads = [
            threading.Thread(target=self._client, args=(k, stop_at), daemon=True)
            for k in range(self.clients)
        ]
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> list[int]:
        """Wait for the clients; returns the ids of requests still unanswered (lost)."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [k for k, t in enumerate(self.threads) if t.is_alive()]

    def _client(self, k: int, stop_at: float) -> None:
        rng = random.Random(self.seed * 1000 + k)
        with grpc.insecure_channel(self.address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            while time.monotonic() < stop_at:
                with self.lock:
                    rid, self.next_rid = self.next_rid, self.next_rid + 1
                out = self._one(stub, rid, rng)
                with self.lock:
                    self.outcomes.append(out)

    def _one(self, stub, rid: int, rng: random.Random) -> Outcome:
        p = rng.randrange(len(self.prompts))
        greedy = rng.random() < GREEDY_SHARE
        reference = self.references[p]
        r = orchestrator_pb2.GenerateRequest(text=self.prompts[p])
        gamma = rng.randint(-1, 6)
        if gamma >= 0:  # else unset: the orchestrator chooses it (adaptive) at every step
            r.gamma = gamma
        if greedy:  # as the reference was made: the same output, token for token
            r.max_new_tokens, r.temperature = self.max_new_tokens, 0.0
        else:
            r.max_new_tokens, r.temperature = rng.randint(4, self.max_new_tokens), 1.0
            r.seed = rng.getrandbits(64)
        start = time.monotonic() - self.t0
        out = Outcome(rid, start, start, greedy, p, r.max_new_tokens, "completed")
        try:
            ids, stats = generate(stub, r)
            if stats is None:
                out.kind = "lost: the stream ended without its statistics"
            else:
                out.ids, out.tokens, out.fallback_steps = ids, len(ids), stats.fallback_steps
                out.duplicated = stats.generated_tokens != len(ids) or len(ids) > r.max_new_tokens
                out.wrong = greedy and ids != reference
        except grpc.RpcError as e:
            out.kind, out.detail = e.code().name, e.details() or ""
        except Exception as e:  # noqa: BLE001 - a client that cannot tell what happened
            out.kind = f"lost: {e!r}"
        out.end = time.monotonic() - self.t0
        return out


# ---- the run -------------------------------------------------------------------------------
@dataclass
class Kill:
    replica: str
    at: float  # seconds since the load began
    up: float  # when the restarted replica answered its health check


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_chaos(
    folder: Path,
    draft: Path,
    target: Path,
    seconds: float,
    clients: int = 32,
    kill_every: tuple[float, float] = (20.0, 40.0),
    victims: list[str] | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = 32,
    seed: int = 0,
    log=print,
    **overrides,
) -> dict:
    """Run the chaos experiment; returns its report (see ``summarize``).

    ``victims`` fixes the order of the replicas killed (else random).
    """
    rng = random.Random(seed)
    prompts = list(prompts or PROMPTS)
    began = time.monotonic()
    say = log

    def log(msg: str) -> None:
        say(f"[{time.monotonic() - began:6.1f}s] {msg}")

    cluster = Cluster(folder, draft, target, **overrides)
    log(f"starting 2 drafts, 2 targets and an orchestrator (logs in {cluster.log_dir})")
    cluster.start()
    try:
        with grpc.insecure_channel(cluster.address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            references = {}
            for i, text in enumerate(prompts):  # the no-fault greedy outputs (and a warm-up)
                req = orchestrator_pb2.GenerateRequest(
                    text=text, max_new_tokens=max_new_tokens, temperature=0.0
                )
                references[i] = generate(stub, req, 300)[0]
        served_before = cluster.metric("orchestrator", "specdec_requests_total")
        log("references computed")
        load = Load(cluster.address, clients, prompts, references, max_new_tokens, seed)
        stop_at = time.monotonic() + seconds
        kills: list[Kill] = []
        rss: list[dict] = []
        sampling = threading.Event()

        def sample_rss() -> None:
            while not sampling.wait(RSS_EVERY_S):
                now = time.monotonic() - load.t0
                for name, pid in cluster.pids().items():
                    mb = rss_mb(pid)
                    if mb is not None:
                        rss.append({"t": now, "process": name, "pid": pid, "mb": mb})

        log(f"{clients} clients for {seconds:.0f} s; a replica killed every {kill_every} s")
        load.start(stop_at)
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        down: set[str] = set()  # roles with a replica down: never both replicas of one
        restarts: list[threading.Thread] = []
        errors: list[str] = []

        def bring_back(victim: str, at: float) -> None:
            try:
                cluster.restart(victim)
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"{victim}: {e!r}")
                return
            kill = Kill(victim, at - load.t0, time.monotonic() - load.t0)
            kills.append(kill)
            down.discard(victim[:-2])
            log(f"{victim} (killed at t={kill.at:.1f}s) is back after {kill.up - kill.at:.1f}s")

        planned = 0
        next_kill = time.monotonic() + rng.uniform(*kill_every)
        while next_kill < stop_at:
            time.sleep(max(0.0, next_kill - time.monotonic()))
            if victims:
                victim = victims[planned % len(victims)]
            else:
                victim = rng.choice([n for n in REPLICAS if n[:-2] not in down] or [None])
            if victim is None or victim[:-2] in down:  # its pair is still down: later
                next_kill = time.monotonic() + 1.0
                continue
            planned += 1
            at = time.monotonic()
            cluster.kill(victim)
            down.add(victim[:-2])
            log(f"t={at - load.t0:.1f}s: kill -9 {victim}")
            restart = threading.Thread(target=bring_back, args=(victim, at), daemon=True)
            restart.start()
            restarts.append(restart)
            next_kill = at + rng.uniform(*kill_every)
        for restart in restarts:
            restart.join(300)
        kills.sort(key=lambda k: k.at)
        hung = load.join(max(0.0, stop_at - time.monotonic()) + REQUEST_TIMEOUT_S + 30)
        sampling.set()
        sampler.join(10)
        leftovers = settle(cluster)
        deadline = time.monotonic() + 10  # the last counts land just after the last answers
        while True:
            served = cluster.metric("orchestrator", "specdec_requests_total") - served_before
            if served >= len(load.outcomes) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        log("load over; every client answered" if not hung else f"{len(hung)} clients hung")
        report = summarize(load.outcomes, kills, rss, hung, served, leftovers)
        report["restart_errors"] = errors
        report["config"] = {
            "seconds": seconds,
            "clients": clients,
            "kill_every_s": list(kill_every),
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "draft": str(draft),
            "target": str(target),
            "overrides": {k: str(v) for k, v in overrides.items()},
        }
        return report
    finally:
        cluster.stop()


def settle(cluster: Cluster, timeout: float = 30.0) -> dict[str, float]:
    """Live requests and sessions once the load is over (all should return to 0)."""
    gauges = {"orchestrator": "specdec_live_requests"}
    gauges.update({n: "specdec_model_live_sessions" for n in REPLICAS})
    deadline = time.monotonic() + timeout
    while True:
        now = {n: cluster.metric(n, m) for n, m in gauges.items()}
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def summarize(
    outcomes: list[Outcome],
    kills: list[Kill],
    rss: list[dict],
    hung: list[int],
    served: float,
    leftovers: dict,
) -> dict:
    """The numbers: requests lost, duplicated, failed; latency during and between kills;
    memory over time."""
    kinds = Counter(o.kind for o in outcomes)
    rids = Counter(o.rid for o in outcomes)
    lost = [o for o in outcomes if o.kind.startswith("lost")]
    completed = [o for o in outcomes if o.kind == "completed"]

    def during(o: Outcome) -> bool:
        return any(o.start <= k.up and o.end >= k.at for k in kills)

    def latencies(rows: list[Outcome]) -> dict:
        xs = [o.end - o.start for o in rows]
        return {"requests": len(xs), "p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99)}

    in_flight = []
    for k in kills:
        hit = [o for o in outcomes if o.start < k.at < o.end]
        in_flight.append(
            {
                **asdict(k),
                "in_flight": len(hit),
                "completed": sum(o.kind == "completed" for o in hit),
                "greedy_identical": sum(
                    o.kind == "completed" and o.greedy and not o.wrong for o in hit
                ),  # fmt: skip
                "failed": dict(Counter(o.kind for o in hit if o.kind != "completed")),
            }
        )
    by_process: dict[str, list[dict]] = {}
    for s in rss:
        up = max((k.up for k in kills if k.replica == s["process"] and k.at <= s["t"]), default=0)
        if s["t"] >= up:  # not while a restarted replica is still loading its model
            by_process.setdefault(s["process"], []).append(s)
    memory = {}
    for name, samples in by_process.items():
        lives: dict[int, list[dict]] = {}  # a restarted replica is a new process
        for s in samples:
            lives.setdefault(s["pid"], []).append(s)
        longest = max(lives.values(), key=lambda xs: xs[-1]["t"] - xs[0]["t"])
        mine = [s["mb"] for s in longest]
        memory[name] = {
            "first_mb": mine[0],
            "last_mb": mine[-1],
            "max_mb": max(mine),
            "restarts": sum(k.replica == name for k in kills),
            "seconds": longest[-1]["t"] - longest[0]["t"],
        }
    return {
        "requests": len(outcomes),
        "outcomes": dict(kinds),
        "lost": len(lost) + len(hung),
        "lost_detail": [o.kind for o in lost][:20] + [f"client {k} hung" for k in hung],
        "duplicated": sum(o.duplicated for o in outcomes) + sum(n - 1 for n in rids.values()),
        "server_counted": served,
        "greedy_wrong": sum(o.wrong for o in completed),
        "greedy_checked": sum(o.greedy for o in completed),
        "fallback_requests": sum(o.fallback_steps > 0 for o in completed),
        "failed_detail": sorted(
            {f"{o.kind}: {o.detail[:120]}" for o in outcomes if o.kind not in ("completed",)}
        )[:20],
        "latency_during_kills": latencies([o for o in completed if during(o)]),
        "latency_between_kills": latencies([o for o in completed if not during(o)]),
        "kills": in_flight,
        "memory": memory,
        "leftovers": leftovers,
        "timeline": [
            {k: v for k, v in asdict(o).items() if k != "ids"} for o in outcomes
        ],  # for the plot
        "rss": rss,
    }


# ---- output --------------------------------------------------------------------------------
def print_report(r: dict, log=print) -> None:
    lat = lambda d: (  # noqa: E731
        f"p50 {d['p50_s']:.2f} s, p99 {d['p99_s']:.2f} s ({d['requests']} requests)"
        if d["requests"]
        else "no requests"
    )
    log(f"requests: {r['requests']} {r['outcomes']}; the orchestrator counted "
        f"{r['server_counted']:.0f}")  # fmt: skip
    log(f"lost: {r['lost']}   duplicated: {r['duplicated']}   "
        f"greedy outputs differing from the no-fault run: {r['greedy_wrong']} "
        f"of {r['greedy_checked']}")  # fmt: skip
    log(f"requests with fallback steps (draft down): {r['fallback_requests']}")
    for f in r["failed_detail"]:
        log(f"  failed: {f}")
    log(f"latency during kills: {lat(r['latency_during_kills'])}")
    log(f"latency between kills: {lat(r['latency_between_kills'])}")
    for k in r["kills"]:
        log(
            f"  t={k['at']:6.1f}s {k['replica']}: back after {k['up'] - k['at']:.1f}s; "
            f"{k['in_flight']} requests in flight, {k['completed']} completed "
            f"({k['greedy_identical']} greedy identical), failed {k['failed']}"
        )
    for name, m in sorted(r["memory"].items()):
        log(
            f"  RSS {name}: {m['first_mb']:.0f} -> {m['last_mb']:.0f} MB (max {m['max_mb']:.0f}) "
            f"over {m['seconds']:.0f} s, {m['restarts']} restart(s)"
        )
    log(f"left over after the load: {r['leftovers']}")
    for e in r.get("restart_errors", []):
        log(f"  a restart failed: {e}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    colors = {"draft": "tab:green", "target": "tab:red"}
    for k in r["kills"]:
        for ax in (ax1, ax2):
            ax.axvspan(k["at"], k["up"], color=colors[k["replica"][:-2]], alpha=0.15, lw=0)
        ax1.annotate(k["replica"], (k["at"], 1.0), xycoords=("data", "axes fraction"),
                     fontsize=7, rotation=90, va="top")  # fmt: skip
    rows = r["timeline"]
    for greedy, color, label in ((True, "tab:blue", "greedy"), (False, "tab:orange", "T=1")):
        xs = [o for o in rows if o["kind"] == "completed" and o["greedy"] == greedy]
        ax1.scatter([o["end"] for o in xs], [o["end"] - o["start"] for o in xs], s=4,
                    color=color, label=f"{label} completed")  # fmt: skip
    failed = [o for o in rows if o["kind"] != "completed"]
    if failed:
        ax1.scatter([o["end"] for o in failed], [o["end"] - o["start"] for o in failed],
                    s=18, marker="x", color="black", label="failed")  # fmt: skip
    ax1.set_ylabel("request latency (s)")
    ax1.set_yscale("log")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(
        f"{r['config']['clients']} clients, 2 drafts + 2 targets, kill -9 every "
        f"{r['config']['kill_every_s'][0]:g}-{r['config']['kill_every_s'][1]:g} s "
        f"(shaded: replica down; green draft, red target)",
        fontsize=10,
    )
    series: dict[tuple[str, int], list] = {}
    for s in r["rss"]:
        series.setdefault((s["process"], s["pid"]), []).append((s["t"], s["mb"]))
    styles = {"orchestrator": "k", "draft-0": "g", "draft-1": "g--", "target-0": "r",
              "target-1": "r--"}  # fmt: skip
    seen = set()
    for (name, _), pts in sorted(series.items()):
        ax2.plot([t for t, _ in pts], [m for _, m in pts], styles.get(name, "b"),
                 label=None if name in seen else name, lw=1)  # fmt: skip
        seen.add(name)
    ax2.set_ylabel("resident memory (MB)")
    ax2.set_xlabel("seconds since the load began")
    ax2.legend(loc="lower right", fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument(
        "--kill-every", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN", "MAX")
    )
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="settings of the services, e.g. orchestrator.pipeline=true (a YAML value each)",
    )
    ap.add_argument("--out", help="results folder (default results/chaos-<timestamp>)")
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "results" / f"chaos-{stamp}"
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    report = run_chaos(
        out / "run",
        Path(args.draft),
        Path(args.target),
        seconds=args.minutes * 60,
        clients=args.clients,
        kill_every=tuple(args.kill_every),
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        log=log,
        **stack_overrides(args.set),
    )
    report["machine"] = machine_info("cpu")
    (out / "chaos.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "chaos.png")
    print_report(report, log)
    log(f"wrote {out / 'chaos.json'} and {out / 'chaos.png'}")
    return 0 if report["lost"] == 0 and report["duplicated"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
