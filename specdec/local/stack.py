"""Draft, target and orchestrator as processes on this machine: the one harness
behind ``specdec up``, the demo, the tests and the benchmarks.

Each service is a real ``specdec serve ROLE`` process on loopback (a child of
this one, or, for the tests, forked from a template: ``specdec.local.forkserver``). A
``Stack`` knows their ports and process ids (it stops only what it started,
by process id), talks to the public API, reads the services' metrics, can pin
each service to its own CPUs (to stand for separate machines), and can start
extra orchestrators (through proxies, with other settings).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.error import URLError
from urllib.request import urlopen

import grpc
import yaml

from specdec.config import load_config
from specdec.local import forkserver
from specdec.transport.channels import channel_credentials

ROLES = ("draft", "target", "orchestrator")


def service_roles(local_models: bool) -> tuple[str, ...]:
    """The services a config runs: all three, or the orchestrator alone where it
    holds the models itself (``orchestrator.local_models``)."""
    return ("orchestrator",) if local_models else ROLES


REPO = Path(__file__).resolve().parent.parent.parent


_PICK = random.Random()  # not the global one: a test that seeds it must not fix our ports
_HANDED_OUT: set[int] = set()  # by this process, perhaps not bound yet


def _listen_range() -> tuple[int, int]:
    """Ports the kernel never gives an outgoing connection: below its ephemeral
    range (Linux: /proc/sys/net/ipv4/ip_local_port_range, usually 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(10_000, low - 12_000), low - 1


def free_port() -> int:
    """A free port for a service this process is about to start. Drawn below the
    ephemeral range: a port the kernel handed out with bind(0) could be taken by
    any outgoing connection (a client, a scrape) before the service binds it,
    which made start-ups fail now and then with "Address already in use"."""
    low, high = _listen_range()
    for _ in range(200 if high > low else 0):
        port = _PICK.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no such range here: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    address: str,
    timeout: float,
    procs: list[subprocess.Popen],
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll the health service at ``address`` until SERVING (TLS with ``credentials``)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    # A service still starting refuses the connection, and gRPC then waits its
    # reconnect backoff (1 s, then 1.6x) before trying again: poll every 0.05 s instead.
    options = [
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 50),
    ]
    channel = (
        grpc.secure_channel(address, credentials, options)
        if credentials
        else grpc.insecure_channel(address, options)
    )
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a service exited during start-up (see its output above)")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"{address} did not become healthy within {timeout:.0f}s")


def wait_http_healthy(
    url: str,
    timeout: float,
    procs: list[subprocess.Popen],
    client_cert: tuple[str, str] | None = None,
) -> None:
    """Poll an HTTP(S) health URL until it answers 200, presenting ``client_cert``
    (certificate and key files) to a server that demands one.

    The certificate of an HTTPS URL is not verified: this only asks a child
    process on this machine whether it is up, and sends nothing secret.
    """
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    if context is not None and client_cert:
        context.load_cert_chain(*client_cert)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a service exited during start-up (see its output above)")
        try:
            with urlopen(url, timeout=2.0, context=context) as r:
                if r.status == 200:
                    return
        except (URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f}s")


def gateway_url(cfg, path: str = "") -> str:
    """The gateway's base URL as seen from this machine (``http(s)://host:port``)."""
    g = cfg.gateway
    host = "127.0.0.1" if g.host in ("0.0.0.0", "") else g.host
    return f"{'https' if g.tls.cert else 'http'}://{host}:{g.port}{path}"


def start_gateway(
    config_path: str | None,
    overrides: list[str] = (),
    quiet: bool = False,
    env: dict[str, str] | None = None,
    stdout=None,
    verbose: bool = False,
    wait_for: str = "/health",
) -> subprocess.Popen:
    """Start ``specdec serve gateway``; returns it once ``wait_for`` answers 200
    (``/health`` needs the orchestrator up, ``/health/live`` only the gateway).
    With ``stdout`` (a file), stdout and stderr go there; ``verbose`` logs at
    DEBUG level."""
    cfg = load_config(config_path, overrides)
    args = [sys.executable, "-m", "specdec", *(["-v"] if verbose else []), "serve", "gateway"]
    if config_path:
        args += ["--config", str(config_path)]
    for o in overrides:
        args += ["--set", o]
    out = subprocess.DEVNULL if quiet else stdout
    err = subprocess.STDOUT if out not in (None, subprocess.DEVNULL) else None
    proc = subprocess.Popen(args, stdout=out, stderr=err, env=env, cwd=REPO)
    try:
        # A gateway demanding client certificates is asked with its own client
        # identity (towards the orchestrator), as start_local checks the orchestrator.
        o_tls = cfg.gateway.orchestrator_tls
        identity = (o_tls.cert, o_tls.key) if cfg.gateway.tls.ca and o_tls.cert else None
        wait_http_healthy(gateway_url(cfg, wait_for), 300, [proc], identity)
    except BaseException:
        stop_local([proc])
        raise
    return proc


def spawn(
    role: str,
    config_path: str | None,
    overrides: list[str] = (),
    out: IO | int | None = None,
    env: dict[str, str] | None = None,
    repo: Path | None = None,
    verbose: bool = False,
) -> subprocess.Popen | forkserver.ForkedProcess:
    """``specdec serve ROLE`` as a child process (forked from a template process that
    has its imports done, where ``SPECDEC_LOCAL_FORKSERVER=1`` asks for it and
    ``env`` and ``out`` allow, a planted ``sitecustomize`` too:
    ``specdec.local.forkserver``). ``repo``: run the code
    of another checkout (a fresh interpreter there; ``benchmarks.against``).
    ``verbose``: DEBUG logging (``specdec -v``)."""
    args = ["-v"] * verbose + ["serve", role]
    if config_path:
        args += ["--config", str(config_path)]
    for o in overrides:
        args += ["--set", o]
    if repo is None and forkserver.wanted(env, out):
        return forkserver.spawn(args, REPO, out, env)
    err = subprocess.STDOUT if out not in (None, subprocess.DEVNULL) else None
    return subprocess.Popen(
        [sys.executable, "-m", "specdec", *args],
        stdout=out,
        stderr=err,
        env=env,
        cwd=repo or REPO,
    )


def pin_process(pid: int, cpus: set[int]) -> None:
    """Run every thread of process ``pid`` on these CPUs (threads it starts later
    inherit it). ``os.sched_setaffinity(pid)`` alone moves only the main thread: a
    service's gRPC threads, which carry every message, would stay on every core."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [pid]:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


def nice_process(pid: int, niceness: int) -> None:
    """Give every thread of process ``pid`` this niceness (threads it starts later
    inherit it; on Linux niceness belongs to each thread). Raising it is always
    allowed; lowering it needs CAP_SYS_NICE (PermissionError)."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [pid]:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # a thread that just ended
            pass


def start_local(
    config_path: str | None,
    overrides: list[str] = (),
    quiet: bool = False,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    on_ready=None,
    gateway: bool = False,
    repo: Path | None = None,
) -> list[subprocess.Popen]:
    """Start the three services (in ``ROLES`` order; the orchestrator alone with
    ``orchestrator.local_models``: ``service_roles``), and the HTTP gateway after
    them with ``gateway``; returns them once all are healthy.

    ``log_dir`` collects each service's output in ROLE.log; ``quiet`` discards it.
    ``on_ready(role)`` is called as each becomes healthy. ``repo``: the services
    run the code of that checkout (``spawn``).
    """
    cfg = load_config(config_path, overrides)
    procs: list[subprocess.Popen] = []
    try:
        # All three start at once: the orchestrator waits for draft and target itself.
        roles = service_roles(cfg.orchestrator.local_models)
        for role in roles:
            out = subprocess.DEVNULL if quiet else None
            if log_dir is not None:
                out = open(log_dir / f"{role}.log", "ab")  # noqa: SIM115 - the child owns it
            procs.append(spawn(role, config_path, list(overrides), out, env, repo))
        # Checked as the orchestrator sees the model services (its upstream TLS),
        # and the API with the same CA (and client certificate) when it has TLS.
        upstream = channel_credentials(cfg.orchestrator.upstream_tls)
        for role in roles[:-1]:  # (the model services)
            section = getattr(cfg, role)
            wait_healthy(f"{section.host}:{section.port}", 300, procs, upstream)
            if on_ready:
                on_ready(role)
        api = upstream if cfg.orchestrator.tls.cert else None
        o = cfg.orchestrator
        wait_healthy(f"{o.host}:{o.port}", 300, procs, api)
        if on_ready:
            on_ready("orchestrator")
        if gateway:
            out = subprocess.DEVNULL if quiet else None
            if log_dir is not None:
                out = open(log_dir / "gateway.log", "ab")  # noqa: SIM115 - the child owns it
            procs.append(start_gateway(config_path, list(overrides), env=env, stdout=out))
            if on_ready:
                on_ready("gateway")
    except BaseException:
        stop_local(procs)
        raise
    return procs


def stop_local(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    """SIGTERM each process we started (by id), then wait; kill what does not stop."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_config(
    folder: Path, draft_model: Path | str, target_model: Path | str, **overrides
) -> tuple[Path, dict]:
    """A config on free loopback ports. Overrides: ``section__key=value`` keyword arguments
    (``orchestrator__gamma=3``) or a nested dict per section (``draft={...}``)."""
    cfg = {
        "draft": {
            "model": str(draft_model),
            "port": free_port(),
            "metrics_port": free_port(),
            "torch_threads": 1,
        },
        "target": {
            "model": str(target_model),
            "port": free_port(),
            "metrics_port": free_port(),
            "torch_threads": 1,
        },
        "orchestrator": {"port": free_port(), "metrics_port": free_port()},
    }
    cfg["orchestrator"]["draft_address"] = f"127.0.0.1:{cfg['draft']['port']}"
    cfg["orchestrator"]["target_address"] = f"127.0.0.1:{cfg['target']['port']}"
    for dotted, value in overrides.items():
        if isinstance(value, dict) and dotted in cfg:
            cfg[dotted].update(value)
            continue
        section, key = dotted.split("__", 1) if "__" in dotted else dotted.split(".", 1)
        cfg[section][key] = value
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@dataclass
class Stack:
    """A running local stack (see the module docstring)."""

    config_path: Path
    config: dict
    procs: list[subprocess.Popen] = field(default_factory=list)
    env: dict[str, str] | None = None
    log_dir: Path | None = None
    extra: list[subprocess.Popen] = field(default_factory=list)
    repo: Path | None = None  # the checkout its processes run (None: this one)
    ROLES = ROLES  # the order of ``procs``

    # ---- where things are --------------------------------------------------------------
    @property
    def orchestrator_address(self) -> str:
        return self.address("orchestrator")

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.config[role]['port']}"

    @property
    def metrics_ports(self) -> dict[str, int]:
        """role -> metrics port, for the services it runs (``roles``)."""
        return {r: self.config[r]["metrics_port"] for r in self.roles}

    def metrics_port(self, role: str) -> int:
        return self.config[role]["metrics_port"]

    @property
    def roles(self) -> tuple[str, ...]:
        """The services it runs, in the order of ``procs`` (``service_roles``)."""
        return service_roles(self.config["orchestrator"].get("local_models", False))

    def proc(self, role: str) -> subprocess.Popen:
        return self.procs[self.roles.index(role)]

    # ---- the public API ----------------------------------------------------------------
    def generate_raw(self, address: str | None = None, timeout: float = 120, **fields):
        """Run one Generate; returns (token ids, text, stats)."""
        from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

        prompt = fields.pop("prompt", None)
        req = orchestrator_pb2.GenerateRequest(**fields)
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt is not None:
            req.token_ids.ids.extend(prompt)
        ids, text, stats = [], "", None
        with grpc.insecure_channel(address or self.orchestrator_address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for msg in stub.Generate(req, timeout=timeout):
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                    text += msg.chunk.text
                else:
                    stats = msg.stats
        return ids, text, stats

    def generate(
        self,
        prompt_text: str,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        gamma: int | None = None,
        **fields,
    ) -> str:
        if gamma is not None:
            fields["gamma"] = gamma
        return self.generate_raw(
            prompt=prompt_text, max_new_tokens=max_new_tokens, temperature=temperature, **fields
        )[1]

    # ---- metrics -----------------------------------------------------------------------
    def metrics_text(self, role: str, port: int | None = None) -> str:
        port = port or self.metrics_ports[role]
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, role: str, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose label text contains ``labels``."""
        total, found = 0.0, False
        for line in self.metrics_text(role).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if labels in line:
                    total += float(line.rsplit(" ", 1)[1])
                    found = True
        return total if found else 0.0

    def live_sessions(self, role: str) -> float:
        return self.metric(role, "specdec_model_live_sessions", f'role="{role}"')

    # ---- processes ---------------------------------------------------------------------
    def signal(self, role: str, sig: int) -> None:
        self.proc(role).send_signal(sig)

    def restart(self, role: str, timeout: float = 120.0) -> None:
        """Start ``role`` again (after it died) on its port; waits until healthy."""
        old = self.proc(role)
        old.wait(timeout)
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            out = open(self.log_dir / f"{role}.log", "ab")  # noqa: SIM115
        new = spawn(role, str(self.config_path), [], out, self.env)
        self.procs[self.roles.index(role)] = new
        wait_healthy(self.address(role), timeout, [new])

    def pin(self, role: str, cpus: set[int], niceness: int | None = None) -> None:
        """Run ``role`` on these CPUs only (standing for a machine of its own), and
        at this niceness if given (``nice_process``)."""
        pin_process(self.proc(role).pid, cpus)
        if niceness is not None:
            nice_process(self.proc(role).pid, niceness)

    def start_orchestrator(
        self, name: str, draft: str, target: str, sets: dict | None = None
    ) -> tuple[str, int]:
        """One more orchestrator (other upstream addresses, other settings);
        returns (address, metrics port)."""
        port, mport = free_port(), free_port()
        sets = {
            "orchestrator.port": port,
            "orchestrator.metrics_port": mport,
            "orchestrator.draft_address": draft,
            "orchestrator.target_address": target,
            **(sets or {}),
        }
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        proc = spawn(
            "orchestrator",
            str(self.config_path),
            [f"{k}={v}" for k, v in sets.items()],
            out,
            self.env,
            self.repo,
        )
        self.extra.append(proc)
        address = f"127.0.0.1:{port}"
        wait_healthy(address, 300, [proc])
        return address, mport

    def pin_extra(self, cores: int | set[int], niceness: int | None = None) -> None:
        """Run the extra orchestrators on this CPU (or these), at this niceness if given."""
        for proc in self.extra:
            pin_process(proc.pid, {cores} if isinstance(cores, int) else cores)
            if niceness is not None:
                nice_process(proc.pid, niceness)

    def stop_extra(self) -> None:
        stop_local(self.extra)
        self.extra = []

    def stop(self) -> None:
        stop_local(self.extra + self.procs)
        self.extra = []


@contextlib.contextmanager
def local_stack(
    folder: Path,
    draft: Path | str,
    target: Path | str,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    **overrides,
) -> Iterator[Stack]:
    """Start a stack on the given model directories; stops it on exit.

    Overrides as in ``write_config``; ``env`` replaces the services' environment.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path, cfg = write_config(folder, draft, target, **overrides)
    stack = Stack(path, cfg, env=env, log_dir=log_dir)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    stack.procs = start_local(str(path), [], quiet=log_dir is None, env=env, log_dir=log_dir)
    try:
        yield stack
    finally:
        stack.stop()
