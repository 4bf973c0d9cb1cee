"""Load through REAL services: many concurrent clients with mixed requests, some
cancelled midway. Nothing is lost or duplicated, identical seeded requests give
identical output under load (no cross-talk between sessions), every session is
freed, memory stays bounded; admission control refuses cleanly at its limits.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .stack import local_stack
from .tiny import CHARS

CLIENTS = 32
REQUESTS = 320
CANCEL_EVERY = 7
REPEATS = 40  # requests that repeat an earlier request's fields exactly (same seed)
ROLES = ("draft", "target", "orchestrator")
RSS_GROWTH_LIMIT_MB = 300
# Statuses a client may get under load, besides OK and its own CANCELLED (none expected
# with these limits): RESOURCE_EXHAUSTED is admission control at its limits.
DOCUMENTED = {grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass
class Job:
    rid: int
    request: orchestrator_pb2.GenerateRequest
    cancel: bool
    same_as: int | None = None


@dataclass
class Outcome:
    rid: int
    kind: str  # "completed", "cancelled" or a status code name
    ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: orchestrator_pb2.GenerationStats | None = None
    detail: str = ""


def make_jobs(rng: random.Random) -> list[Job]:
    jobs = []
    for rid in range(REQUESTS - REPEATS):
        temperature = rng.choice([0.0, 0.0, 0.7, 1.0, 1.3])
        req = orchestrator_pb2.GenerateRequest(
            text="".join(rng.choice(CHARS[:40]) for _ in range(rng.randint(1, 40))),
            max_new_tokens=rng.randint(1, 24),
            temperature=temperature,
            top_k=rng.choice([0, 0, 3, 10]),
            seed=10_000 + rid,
            gamma=rng.randint(0, 8),
        )
        if rng.random() < 0.5:
            req.top_p = rng.choice([0.5, 0.9, 1.0])
        if rng.random() < 0.3:
            req.stop.extend(rng.sample(["e", "th", "a ", "!", "zz"], rng.randint(1, 2)))
        cancel = rid % CANCEL_EVERY == CANCEL_EVERY - 1 and req.max_new_tokens >= 4
        jobs.append(Job(rid, req, cancel))
    originals = [j for j in jobs if not j.cancel]
    for k, orig in enumerate(rng.sample(originals, REPEATS)):
        copy = orchestrator_pb2.GenerateRequest()
        copy.CopyFrom(orig.request)
        jobs.append(Job(REQUESTS - REPEATS + k, copy, False, same_as=orig.rid))
    rng.shuffle(jobs)
    return jobs


def run_job(stub, job: Job) -> Outcome:
    out = Outcome(job.rid, "completed")
    call = stub.Generate(job.request, timeout=120)
    try:
        for msg in call:
            if msg.HasField("chunk"):
                out.ids += msg.chunk.token_ids
                out.text += msg.chunk.text
                if job.cancel:
                    call.cancel()
            else:
                out.stats = msg.stats
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and job.cancel:
            out.kind = "cancelled"
        else:
            out.kind, out.detail = e.code().name, e.details() or ""
    if out.kind == "completed" and out.stats is None:
        out.kind = "no-stats"  # a stream that ended without its statistics: a lost request
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def requests_by_code(stack) -> dict[str, float]:
    counts = collections.Counter()
    for line in stack.metrics_text("orchestrator").splitlines():
        if line.startswith("specdec_requests_total{"):
            code = line.split('code="', 1)[1].split('"', 1)[0]
            counts[code] += float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture(scope="module")
def load_stack(tmp_path_factory, llama_pair):
    with local_stack(
        tmp_path_factory.mktemp("load"),
        *llama_pair,
        orchestrator__max_concurrent_requests=CLIENTS,
        orchestrator__max_queued_requests=2 * CLIENTS,
        # Two shared CPU cores serve 32 clients: a draft call may wait its turn for a
        # while; a generous timeout keeps speculation (and seeded outputs) deterministic.
        orchestrator__draft_timeout_s=30,
        orchestrator__grace_period_s=2,
        draft__grace_period_s=2,
        target__grace_period_s=2,
    ) as stack:
        yield stack


def test_concurrent_mixed_load_loses_nothing(load_stack):
    stack = load_stack
    for _ in range(3):  # warm up (lazy allocations) before the memory baseline
        stack.generate_raw(prompt="warm up", max_new_tokens=24, temperature=1.0, gamma=8)
    rss_before = {r: rss_mb(p.pid) for r, p in zip(ROLES, stack.procs, strict=True)}
    codes_before = requests_by_code(stack)

    jobs = make_jobs(random.Random(1234))
    work: queue.Queue[Job] = queue.Queue()
    for job in jobs:
        work.put(job)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    channels = [grpc.insecure_channel(stack.orchestrator_address) for _ in range(4)]

    def client(n: int) -> None:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channels[n % len(channels)])
        while True:
            try:
                job = work.get_nowait()
            except queue.Empty:
                return
            try:
                out = run_job(stub, job)
            except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                out = Outcome(job.rid, "client-error", detail=repr(e))
            with lock:
                outcomes.append(out)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    took = time.monotonic() - t0
    for ch in channels:
        ch.close()
    assert not any(t.is_alive() for t in threads), "clients still running after 300 s"

    # Every request accounted for exactly once.
    by_id = collections.Counter(o.rid for o in outcomes)
    assert sorted(by_id) == list(range(REQUESTS)) and set(by_id.values()) == {1}
    kinds = collections.Counter(o.kind for o in outcomes)
    tokens = sum(len(o.ids) for o in outcomes)
    print(
        f"\n{REQUESTS} requests from {CLIENTS} clients in {took:.1f}s "
        f"({REQUESTS / took:.1f} req/s, {tokens / took:.0f} tokens/s): {dict(kinds)}"
    )
    allowed = {"completed", "cancelled"} | {c.name for c in DOCUMENTED}
    assert set(kinds) <= allowed, [
        (o.rid, o.kind, o.detail) for o in outcomes if o.kind not in allowed
    ]
    jobs_by_id = {j.rid: j for j in jobs}
    outs_by_id = {o.rid: o for o in outcomes}
    fallbacks = 0
    for o in outcomes:
        if o.kind != "completed":
            continue
        req, s = jobs_by_id[o.rid].request, o.stats
        fallbacks += s.fallback_steps
        assert s.generated_tokens == len(o.ids), (o.rid, s)
        assert 1 <= len(o.ids) <= req.max_new_tokens or s.finish_reason in ("stop", "eos")
        assert s.finish_reason in ("length", "stop", "eos"), s
        if s.finish_reason == "length":
            assert len(o.ids) == req.max_new_tokens, (o.rid, s)
        assert s.prompt_tokens == len(req.text)  # one token per character
    cancelled = kinds["cancelled"]
    assert cancelled >= REQUESTS // (2 * CANCEL_EVERY), kinds  # the cancellations did happen

    # Identical seeded requests give identical output, even interleaved with 31 others.
    compared = 0
    for job in jobs:
        if job.same_as is None:
            continue
        a, b = outs_by_id[job.rid], outs_by_id[job.same_as]
        if (
            a.kind == b.kind == "completed"
            and a.stats.fallback_steps == b.stats.fallback_steps == 0
        ):
            assert (a.ids, a.text) == (b.ids, b.text), (job.rid, job.same_as)
            compared += 1
    assert compared >= REPEATS // 2, compared
    print(
        f"{compared} repeated seeded requests matched their originals; {fallbacks} fallback steps"
    )

    # The server saw each request once: its final statuses add up to what the clients sent.
    def server_counts():
        now = requests_by_code(stack)
        return {k: now[k] - codes_before.get(k, 0) for k in now if now[k] - codes_before.get(k, 0)}

    wait_for(lambda: sum(server_counts().values()) >= REQUESTS, 20, "the server's request counts")
    server = server_counts()
    assert sum(server.values()) == REQUESTS, server
    assert set(server) <= {"OK", "CANCELLED"} | {c.name for c in DOCUMENTED}, server
    # A cancel can cross the final message on the wire: the server may count it OK.
    assert server.get("OK", 0) >= kinds["completed"], (server, kinds)
    assert server.get("CANCELLED", 0) <= cancelled, (server, kinds)

    # Nothing left behind.
    def idle():
        return (
            stack.live_sessions("draft") == 0
            and stack.live_sessions("target") == 0
            and stack.metric("orchestrator", "specdec_live_requests") == 0
            and stack.metric("orchestrator", "specdec_queued_requests") == 0
        )

    wait_for(idle, 20, "live sessions, live and queued requests to return to 0")

    rss_after = {r: rss_mb(p.pid) for r, p in zip(ROLES, stack.procs, strict=True)}
    growth = {r: rss_after[r] - rss_before[r] for r in ROLES}
    print(
        "RSS MB before -> after: "
        + ", ".join(
            f"{r} {rss_before[r]:.0f} -> {rss_after[r]:.0f} ({growth[r]:+.0f})" for r in ROLES
        )
    )
    for r in ROLES:
        assert growth[r] < RSS_GROWTH_LIMIT_MB, f"{r} grew {growth[r]:.0f} MB under load"


def test_admission_control_refuses_beyond_the_limits(tmp_path, llama_pair):
    with (
        local_stack(
            tmp_path,
            *llama_pair,
            orchestrator__max_concurrent_requests=1,
            orchestrator__max_queued_requests=0,
            orchestrator__grace_period_s=1,
            draft__grace_period_s=1,
            target__grace_period_s=1,
        ) as stack,
        grpc.insecure_channel(stack.orchestrator_address) as ch,
    ):
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        long = stub.Generate(
            orchestrator_pb2.GenerateRequest(text="a long one", max_new_tokens=1000, seed=1),
            timeout=120,
        )
        next(long)  # it is generating: the one slot is taken
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(orchestrator_pb2.GenerateRequest(text="me too", max_new_tokens=4),
                               timeout=30))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert time.monotonic() - t0 < 5, "refused, but not at once"
        details = err.value.details()
        assert "max_concurrent_requests=1" in details and "max_queued_requests=0" in details, (
            details
        )
        long.cancel()
        wait_for(
            lambda: stack.metric("orchestrator", "specdec_live_requests") == 0,
            20,
            "the slot to free",
        )
        ids, _, stats = stack.generate_raw(prompt="after", max_new_tokens=4, temperature=0.0)
        assert stats.generated_tokens == len(ids) == 4
        assert (
            stack.metric("orchestrator", "specdec_requests_total", 'code="RESOURCE_EXHAUSTED"') == 1
        )
