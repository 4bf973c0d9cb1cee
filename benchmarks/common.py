"""What the benchmark scripts share: the prompt set, machine information,
Prometheus scraping, starting the services (through ``specdec.local.stack``,
the same harness as the tests) and a thin Generate client. No measurement
logic lives here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import grpc
import yaml

from specdec.local.stack import Stack, start_local, write_config
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFT = REPO / "models" / "demo" / "draft"
DEFAULT_TARGET = REPO / "models" / "demo" / "target"

# Held-out style prompts: written for this benchmark in the manner of the demo
# pair's corpus (early 19th-century English prose), not copied from it.
PROMPTS = (
    "It was a fine morning in the early spring, and Miss Bennet had walked out",
    '"I cannot think," said Mrs. Dashwood, "why you should',
    "Sir Thomas returned from Antigua much sooner than any of the family",
    "The ball at Netherfield was talked of for a whole week before",
    "Anne had not seen Captain Wentworth for eight years, and",
    "Emma walked to the window and watched the carriage",
    "My dear Fanny, you must not suppose that",
    "There was nothing in the letter to alarm her, and yet",
    "Catherine had never read a novel so delightful as",
    "The Miss Steeles were invited to spend the evening at the Park, and",
)


def rotated_rounds(names: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(round, name) for ``repeats`` rounds of every name, the order rotating each
    round so that no configuration always goes first (or right after another)."""
    for r in range(repeats):
        for i in range(len(names)):
            yield r, names[(i + r) % len(names)]


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a file (a JSON list of strings, or one prompt per line), or the built-ins."""
    if not path:
        return list(PROMPTS)
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        prompts = [str(p) for p in json.loads(text)]
    else:
        prompts = [line.rstrip("\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return ""


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` intra-op threads inside the block, as before after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def module_at(rev: str, path: str) -> types.ModuleType:
    """The module in the repository file ``path`` as it was at git revision ``rev``
    (benchmarks' ``--against``), loaded beside this build's."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"{Path(path).stem}_at_{rev}")
    sys.modules[module.__name__] = module  # (dataclasses look their module up)
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def service_settings(pairs: list[str], option: str = "--set") -> dict[str, dict]:
    """``option``'s ``section.key=value`` pairs (a YAML value) as start_services'
    settings."""
    out: dict[str, dict] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        section, _, name = key.partition(".")
        if not (section and name and _):
            raise SystemExit(f"{option} {pair}: want section.key=value")
        out.setdefault(section, {})[name] = yaml.safe_load(value)
    return out


def stack_overrides(pairs: list[str], option: str = "--set") -> dict[str, Any]:
    """``option``'s ``section.key=value`` pairs as ``write_config`` keyword overrides
    (``section__key=value``: a section's name may be a parameter's too, ``target``)."""
    return {
        f"{section}__{key}": value
        for section, keys in service_settings(pairs, option).items()
        for key, value in keys.items()
    }


def machine_info(device: str) -> dict:
    import google.protobuf
    import grpc
    import torch
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grpc": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "device": device,
        "git_commit": git_commit(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def finish(out: Path, result: dict, report: Callable[[dict], str]) -> int:
    """A standalone benchmark's end: the load average now, ``result`` as
    results.json, ``report(result)`` as results.md and on stdout; exit code 0."""
    result["load_average_end"] = list(os.getloadavg())
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = report(result)
    (out / "results.md").write_text(md)
    print(md)
    return 0


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def model_summary(model, path: str) -> dict:
    cfg = model.config
    return {
        "path": str(path),
        "architecture": type(model).__name__,
        "parameters": param_count(model),
        "layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
    }


# ---- Prometheus -----------------------------------------------------------------------
Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(port: int) -> dict[Sample, float]:
    """All samples of one /metrics endpoint: {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def delta(after: dict[Sample, float], before: dict[Sample, float]) -> dict[Sample, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def add_into(total: dict[Sample, float], d: dict[Sample, float]) -> None:
    for k, v in d.items():
        total[k] = total.get(k, 0.0) + v


def pick(samples: dict[Sample, float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            total += v
    return total


def knows(repo: Path | None, key: str) -> bool:
    """Whether the services of ``repo`` (None: this checkout) take the config ``key``:
    an older revision's (``benchmarks.against``) refuses keys it does not know, and
    runs as it did without them."""
    if repo is None:
        return True
    return f"    {key}:" in (repo / "specdec" / "config.py").read_text()


# The target's threads for passes of plain decoding steps alone, as configs/default.yaml
# sets it for the local stack on these 2 cores (docs/benchmarks.md, "A second thread for
# plain passes").
PLAIN_THREADS = 2


def start_services(
    out: Path,
    draft: str,
    target: str,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 2,
    draft_threads: int | None = None,
    settings: dict[str, dict] | None = None,
    repo: Path | None = None,
    plain_threads: int = PLAIN_THREADS,
) -> Stack:
    """Draft, target and orchestrator on free ports (``specdec.local.stack``), logging
    into ``out/logs``; returns once all three are healthy. ``settings``: more config
    keys per section (``{"target": {"packed_linear": False}}``); ``repo``: the
    services run that checkout's code; ``plain_threads``: the target's
    ``plain_torch_threads`` (as configs/default.yaml; a pinned target takes no more
    than its core)."""
    sections = {
        role: {
            "device": device,
            "dtype": dtype,
            "torch_threads": draft_threads if role == "draft" and draft_threads else threads,
        }
        for role in ("draft", "target")
    }
    if plain_threads and knows(repo, "plain_torch_threads"):
        sections["target"]["plain_torch_threads"] = plain_threads
    # Generous: a benchmark must not fall back to plain decoding on a slow step.
    sections["orchestrator"] = {"draft_timeout_s": 10.0, "max_concurrent_requests": 32}
    for section, keys in (settings or {}).items():
        sections.setdefault(section, {}).update(keys)
    out.mkdir(parents=True, exist_ok=True)
    path, cfg = write_config(out, draft, target, **sections)
    (out / "services.yaml").write_text(path.read_text())
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(path, cfg, log_dir=log_dir, repo=repo)
    stack.procs = start_local(str(path), [], log_dir=log_dir, repo=repo)
    return stack


@contextlib.contextmanager
def stacks_per_arm(
    out: Path, draft: str, target: str, key: str, arms: dict[str, object]
) -> Iterator[dict[str, Stack]]:
    """One stack per arm (``{arm: value}``), its draft and target services with the
    model-service setting ``key`` set to the arm's value (a dict value: those
    settings), one thread each (as the side-by-side benchmarks run them); all
    stopped on exit."""
    stacks: dict[str, Stack] = {}
    try:
        for arm, value in arms.items():
            keys = value if isinstance(value, dict) else {key: value}
            stacks[arm] = start_services(
                out / arm, draft, target, threads=1, draft_threads=1,
                settings={"draft": keys, "target": keys},
            )  # fmt: skip
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


class Client:
    """One channel to an orchestrator; ``generate`` returns the request's numbers."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def _request(prompt: str | list[int], max_new_tokens: int, fields: dict):
        """A GenerateRequest; a field given as None is left unset."""
        fields = {k: v for k, v in fields.items() if v is not None}
        req = orchestrator_pb2.GenerateRequest(max_new_tokens=max_new_tokens, **fields)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def stream(self, prompt: str | list[int], max_new_tokens: int, **fields) -> Iterator[int]:
        """One Generate: the number of tokens in each chunk, as the chunk arrives.
        ``fields`` as for ``generate``."""
        for msg in self.stub.Generate(self._request(prompt, max_new_tokens, fields), timeout=600):
            if msg.HasField("chunk"):
                yield len(msg.chunk.token_ids)

    def generate(self, prompt: str | list[int], max_new_tokens: int, **fields) -> dict:
        """One Generate. ``fields``: GenerateRequest fields (temperature, gamma, overlap,
        seed, dense, ...); a gamma or seed of None is left unset."""
        req = self._request(prompt, max_new_tokens, fields)
        t0 = time.perf_counter()
        tokens, stats = 0, None
        for msg in self.stub.Generate(req, timeout=600):
            if msg.HasField("chunk"):
                tokens += len(msg.chunk.token_ids)
            else:
                stats = msg.stats
        wall = time.perf_counter() - t0
        s = stats
        return {
            "tokens": s.generated_tokens if s else tokens,
            "wall_s": wall,
            "server_s": s.total_time_s,
            "ttft_s": s.time_to_first_token_s,
            "steps": s.steps,
            "drafted": s.drafted_tokens,
            "accepted": s.accepted_tokens,
            "judged": s.judged_tokens,
            "wire_bytes": s.wire_bytes_per_token * s.generated_tokens,
            "round_trips": s.round_trips,
            "fallback_steps": s.fallback_steps,
            "overlapped_steps": s.overlapped_steps,
            "gamma_sum": s.mean_gamma * s.steps,
            "steps_s": s.steps_s,
            "draft_forward_s": s.draft_forward_s,
            "target_forward_s": s.target_forward_s,
            "finish": s.finish_reason,
        }


def info_rtt_ms(address: str, calls: int = 30) -> float:
    """Median latency of a draft service's Info RPC at ``address`` (through a proxy or not)."""
    with grpc.insecure_channel(address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        stub.Info(common_pb2.InfoRequest(), timeout=10)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            stub.Info(common_pb2.InfoRequest(), timeout=10)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3
