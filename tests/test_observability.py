"""Checks of the Grafana dashboard and the Prometheus rules (docs/observability.md).

Static part: ``promtool check rules`` and ``promtool test rules`` pass, the
PrometheusRule carries exactly the rules file's groups, every alert is unit-tested
firing and not firing, every dashboard and rule expression parses, every ratio is
guarded against division by zero and every metric name exists in specdec.metrics.

Integration part: a real Prometheus server scrapes a local stack (draft, target,
orchestrator and the HTTP gateway) while a short generation load runs, over gRPC
and through the gateway (streamed and not); every dashboard expression, every recording
rule (its expression and its recorded series) and every alert expression with
its threshold comparison removed must return data, every rule must evaluate
without error, and ``promtool check metrics`` must accept each service's /metrics.

promtool and prometheus are required (Debian/Ubuntu: ``apt-get install prometheus``):
without them these tests FAIL rather than skip, so that CI cannot pass vacuously.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from specdec.local.stack import free_port

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "specdec-rules.yaml"
RULES_TEST = REPO / "deploy" / "prometheus" / "specdec-rules.test.yaml"
PROMETHEUS_RULE = REPO / "deploy" / "prometheus" / "prometheusrule.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "specdec-dashboard.json"

JOBS = {
    "orchestrator": "specdec-orchestrator",
    "draft": "specdec-draft",
    "target": "specdec-target",
    "gateway": "specdec-gateway",
}
# Grafana template variables and what the tests put in their place: all jobs,
# all instances, all models; $__rate_interval as Grafana computes it for a 1s
# scrape interval would be 4s, a wider window makes the test robust.
RATE_INTERVAL = "30s"
GATEWAY_MODEL = "specdec-test"  # tests.gateway_stack.MODEL
VARIABLES = {"job": ".*", "instance": ".*", "model": ".*", "datasource": ""}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH. The observability checks need Prometheus' binaries "
            "(Debian/Ubuntu: `apt-get install prometheus`, or the release tarball from "
            "prometheus.io); CI installs them.",
            pytrace=False,
        )
    return path


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def _load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _rules() -> list[dict]:
    return [r for g in _load_yaml(RULES)["groups"] for r in g["rules"]]


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, raw expr) of every query of every panel, rows included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(_dashboard()["panels"])
    return out


def substitute(expr: str) -> str:
    """A Grafana query as Prometheus would receive it in the tests."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace(
        "${__rate_interval}", RATE_INTERVAL
    )

    def var(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in VARIABLES:
            raise AssertionError(f"unknown template variable ${name} in {expr!r}")
        return VARIABLES[name]

    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", var, expr)
    assert "$" not in out, out
    return out


# A comparison of a vector with a number literal: `> 0.3`, `== 0`, `< bool 1e-3`.
_THRESHOLD = re.compile(
    r"\s*(?:==|!=|<=|>=|<|>)\s*(?:bool\s+)?[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?(?![\w.])",
    re.IGNORECASE,
)


def strip_thresholds(expr: str) -> str:
    """An alert expression without its threshold comparisons: the quantity alerted on.

    ``a < 0.3 and on (job) b > 0`` becomes ``a and on (job) b``, which returns
    data whenever the inputs exist, firing or not.
    """
    return _THRESHOLD.sub("", expr)


def all_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard query and every rule, variables substituted."""
    exprs = [(f"dashboard panel {t!r}", substitute(e)) for t, e in _dashboard_targets()]
    for r in _rules():
        if "record" in r:
            exprs.append((f"recording rule {r['record']}", r["expr"]))
        else:
            exprs.append((f"alert {r['alert']} (threshold removed)", strip_thresholds(r["expr"])))
    return exprs


# ---------------------------------------------------------------------------
# Static checks
# ---------------------------------------------------------------------------


def test_promtool_check_rules():
    res = _run([_tool("promtool"), "check", "rules", str(RULES)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_rule_unit_tests():
    res = _run([_tool("promtool"), "test", "rules", str(RULES_TEST)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_prometheusrule_has_the_same_groups_as_the_rules_file():
    pr = _load_yaml(PROMETHEUS_RULE)
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["kind"] == "PrometheusRule"
    assert pr["metadata"]["name"] == "specdec"
    assert pr["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specdec"
    assert pr["metadata"]["labels"].get("release"), "the operator's ruleSelector needs it"
    assert set(pr) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(pr["spec"]) == {"groups"}
    assert pr["spec"]["groups"] == _load_yaml(RULES)["groups"], (
        "deploy/prometheus/prometheusrule.yaml is out of date: refresh it from "
        "specdec-rules.yaml (command in its header)"
    )


def test_alerts_are_complete_and_each_is_unit_tested_firing_and_not_firing():
    alerts = [r for r in _rules() if "alert" in r]
    names = {a["alert"] for a in alerts}
    assert {
        "SpecdecServiceDown",
        "SpecdecAcceptanceRateCollapsed",
        "SpecdecSpeculationDisabled",
        "SpecdecFallbackActive",
        "SpecdecHighRequestLatency",
        "SpecdecHighErrorRate",
        "SpecdecExactnessDrift",
    } <= names
    for a in alerts:
        assert a["labels"]["severity"] in {"warning", "critical"}, a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]
        assert re.fullmatch(r"\d+[smh]", a.get("for", "")), f"{a['alert']} needs a `for`"

    firing, quiet = set(), set()
    tested_exprs = []
    for case in _load_yaml(RULES_TEST)["tests"]:
        for t in case.get("alert_rule_test", []):
            (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
        tested_exprs += [t["expr"] for t in case.get("promql_expr_test", [])]
    assert names <= firing, f"never tested firing: {sorted(names - firing)}"
    assert names <= quiet, f"never tested not firing: {sorted(names - quiet)}"
    # Every recorded series that is a result (not just an input rate) has its value tested.
    for r in _rules():
        if "record" in r and re.search(r"ratio|rate:|per_step|gamma|p99", r["record"]):
            assert any(r["record"] in e for e in tested_exprs), f"untested: {r['record']}"


def test_dashboard_structure():
    d = _dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    assert d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance", "model"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    assert "label_values(specdec_build_info, model_id)" in variables["model"]["query"]

    ids, cells = set(), set()
    panels = [p for p in d["panels"]]
    for p in panels:
        assert p["id"] not in ids, f"duplicate panel id {p['id']}"
        ids.add(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "bargauge", "table", "gauge", "heatmap"}
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']!r} has no unit"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["expr"].strip(), p["title"]

    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in (
        "throughput",
        "time to first token",
        "inter-token",
        "end-to-end",
        "acceptance rate",
        "by draft position",
        "realised vs theoretical",
        "stage latency",
        "wire bytes per generated token",
        "live sessions",
        "cached tokens",
        "error and fallback rate",
        "forward pass",
        "rpc rate by code",
        "gateway requests by endpoint and status",
        "gateway request duration",
        "gateway time to first byte",
        "gateway requests in flight",
    ):
        assert topic in titles, f"no panel about {topic!r}"


def test_every_expression_parses(tmp_path):
    """promtool parses each dashboard query and rule (as a recording rule)."""
    rules = [
        {"record": f"check:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(all_expressions())
    ]
    path = tmp_path / "all-exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "all", "rules": rules}]}))
    res = _run([_tool("promtool"), "check", "rules", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr


# What may follow a `/`: a guard that keeps the denominator away from zero.
_GUARDED_DIVISION = re.compile(
    r"/\s*(?:on\s*\([^)]*\)\s*(?:group_left|group_right)?\s*(?:\([^)]*\))?\s*)?"
    r"(?:clamp_min\(|\(1 - clamp_max\()"
)


def _strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def test_every_ratio_is_guarded_against_division_by_zero():
    for where, expr in all_expressions():
        code = _strip_strings(expr)
        for m in re.finditer("/", code):
            assert _GUARDED_DIVISION.match(code, m.start()), (
                f"{where}: unguarded division at ...{code[m.start() : m.start() + 60]}"
            )


def _metric_sample_names() -> set[str]:
    """Sample names of every metric declared in specdec.metrics."""
    from prometheus_client.metrics import MetricWrapperBase

    import specdec.metrics as m

    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "info": ("_info",),
    }
    names = set()
    for value in vars(m).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names.update(family.name + s for s in suffixes[family.type])
    return names


def test_every_metric_name_exists_and_every_metric_is_on_the_dashboard():
    known = _metric_sample_names()
    assert "specdec_generated_tokens_total" in known and "specdec_build_info" in known
    recorded = {r["record"] for r in _rules() if "record" in r}
    used = set()
    for where, expr in all_expressions():
        for name in re.findall(r"\b(specdec_\w+)", _strip_strings(expr)):
            assert name in known, f"{where}: unknown metric {name}"
            used.add(name)
        for name in re.findall(r"\b(specdec:[\w:]+)", expr):
            assert name in recorded, f"{where}: unknown recorded series {name}"
    on_dashboard = {n for _, e in _dashboard_targets() for n in re.findall(r"\b(specdec_\w+)", e)}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in on_dashboard}
    missing = {n for n in known if re.sub(r"_(bucket|sum|count)$", "", n) not in families}
    assert not missing, f"metrics not on the dashboard: {sorted(missing)}"


def test_labelled_is_the_series_labels_gives_and_counts_into_it():
    from specdec import metrics

    child = metrics.labelled(metrics.WIRE_BYTES, "draft", "sent")
    assert child is metrics.WIRE_BYTES.labels("draft", "sent")
    assert metrics.labelled(metrics.WIRE_BYTES, "draft", "sent") is child
    assert metrics.labelled(metrics.WIRE_BYTES, "draft", "received") is not child
    registry = metrics.registry_for("orchestrator")
    labels = {"peer": "draft", "direction": "sent"}
    before = registry.get_sample_value("specdec_wire_bytes_total", labels) or 0.0
    child.inc(7)
    assert registry.get_sample_value("specdec_wire_bytes_total", labels) == before + 7


def test_threshold_stripping():
    assert strip_thresholds('up{job=~"specdec.*"} == 0') == 'up{job=~"specdec.*"}'
    assert (
        strip_thresholds("a:b < 0.3\nand on (namespace, job) c:d > 0")
        == "a:b\nand on (namespace, job) c:d"
    )
    assert strip_thresholds('x{code!="OK", le="0.5"} > 1e-3') == 'x{code!="OK", le="0.5"}'
    for r in _rules():
        if "alert" in r:
            assert strip_thresholds(r["expr"]) != r["expr"], r["alert"]


# ---------------------------------------------------------------------------
# Integration: a real Prometheus scraping a real local stack
# ---------------------------------------------------------------------------


class PrometheusServer:
    """A throw-away Prometheus: 1s scrapes and rule evaluations, data in a tmp dir.

    It listens on a free port and is stopped by its own process id: a Prometheus
    the tests did not start (the system's, a user's) is never touched.
    """

    def __init__(self, binary: str, workdir: Path, targets: dict[str, int]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": JOBS[role], "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for role, port in targets.items()
            ],
        }
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115
        self.log_path = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready(60)
        except BaseException:
            self.stop()  # never leave a half-started one behind
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready:\n{self.log_path.read_text()}")
            time.sleep(0.2)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def wait_for(self, expr: str, what: str, timeout: float = 30, ok=bool) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {expr} -> {result}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop this server (by its process id) and wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "it is a truth universally acknowledged",
    "hello there, general",
    "speculative decoding drafts tokens; the target verifies them",
]


def _gateway_request(gateway_url: str, i: int) -> None:
    """One request through the HTTP gateway: completion or chat, streamed or not."""
    chat = i % 2 == 1
    body = {"model": GATEWAY_MODEL, "max_tokens": 12, "temperature": (0.0, 1.0)[i % 3 == 0]}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    else:
        body["prompt"] = PROMPTS[i % len(PROMPTS)]
    body["stream"] = i % 4 < 2
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(
        gateway_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = r.read()
    assert r.status == 200 and (not body["stream"] or out.endswith(b"data: [DONE]\n\n")), out


def _run_load(
    stack, seconds: float, workers: int = 3, gateway_url: str | None = None
) -> list[BaseException]:
    """Generations from a few threads for at least ``seconds``, with varied gamma and
    temperature (greedy and sampled), plus one thread of requests through the
    gateway at ``gateway_url``. Returns the errors raised, if any."""
    errors: list[BaseException] = []
    done = [0]
    stop_at = time.monotonic() + seconds

    def http_worker() -> None:
        i = 0
        while time.monotonic() < stop_at or i < 4:
            try:
                _gateway_request(gateway_url, i)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
                return
            i += 1

    def worker(k: int) -> None:
        i = k
        while time.monotonic() < stop_at or done[0] < 2 * workers:
            try:
                stack.generate(
                    PROMPTS[i % len(PROMPTS)],
                    max_new_tokens=24,
                    temperature=(0.0, 1.0)[i % 2],
                    gamma=1 + i % 4,
                )
                done[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
                return
            i += workers

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(workers)]
    if gateway_url:
        threads.append(threading.Thread(target=http_worker, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 180)
    return errors


def _has_data(result: list[dict]) -> bool:
    return len(result) > 0


# What one process never counts, so the panels that show it stay empty there.
ONE_PROCESS_NEVER = {
    "specdec_wire_bytes_total": "no wire: q is handed over unpacked",
    "specdec_overlapped_steps_total": "no step drafts ahead: one event loop",
    "specdec_relayed_steps_total": "no relays: the engine calls verify itself",
    "specdec_model_draft_guesses_total": "no guesses: nothing is drafted during a verify",
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("local_models", [False, True], ids=["services", "one-process"])
def test_dashboard_and_rules_return_data_from_a_live_stack(tmp_path, local_models):
    """Every panel and rule has data from a real stack under load: the three
    services, or one orchestrator with both models in its process (whose
    endpoint carries the models' metrics and build info too)."""
    prometheus_bin = _tool("prometheus")
    promtool = _tool("promtool")
    from tests.gateway_stack import gateway
    from tests.stack import local_stack

    with (
        local_stack(tmp_path / "stack", orchestrator__local_models=local_models) as stack,
        gateway(
            tmp_path / "gateway",
            stack.config,
            stack.orchestrator_address,
            chat_template="plain-text",  # the tiny tokenizer has no chat template
        ) as gw,
    ):
        targets = {**stack.metrics_ports, "gateway": gw.metrics_port}
        prom = PrometheusServer(prometheus_bin, tmp_path / "prometheus", targets)
        try:
            prom.wait_for(
                'up{job=~"specdec.*"} == 1',
                "every service to be scraped",
                ok=lambda r: len(r) == len(targets),
            )
            errors = _run_load(stack, seconds=8, gateway_url=gw.url)
            assert not errors, f"generation failed: {errors[0]!r}"
            # Two more scrapes of the final counters and a rule evaluation on them.
            prom.wait_for("specdec:tokens_per_step:rate5m > 0", "the recording rules", timeout=30)
            time.sleep(3)
            at = time.time()

            empty = []
            for where, expr in all_expressions():
                if local_models and any(m in expr for m in ONE_PROCESS_NEVER):
                    continue
                if not _has_data(prom.query(expr, at)):
                    empty.append(f"{where}: {expr}")
            for r in _rules():
                if "record" in r and not _has_data(prom.query(r["record"], at)):
                    empty.append(f"recorded series {r['record']}")
            assert not empty, "expressions without data:\n" + "\n".join(empty)

            # Every template variable has values to offer.
            for v in _dashboard()["templating"]["list"]:
                m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v.get("query", "") or "")
                if v["type"] == "query" and m:
                    values = prom.api(
                        f"label/{m.group(2)}/values", **{"match[]": substitute(m.group(1))}
                    )
                    assert values, f"variable ${v['name']} has no values"

            # The load ran: a few sanity checks on the orchestrator's values.
            def value(name: str) -> float:
                result = prom.query(f'{name}{{job="{JOBS["orchestrator"]}"}}', at)
                assert len(result) == 1, (name, result)
                return float(result[0]["value"][1])

            assert 0 <= value("specdec:acceptance_rate:rate5m") <= 1
            assert value("specdec:generated_tokens:rate5m") > 0
            assert value("specdec:tokens_per_step:rate5m") >= 1
            theory = value("specdec:theoretical_tokens_per_step:rate5m")
            assert math.isfinite(theory) and theory >= 1
            assert value("specdec:request_error_ratio:rate5m") == 0
            if local_models:  # both models' passes, under the orchestrator's job
                by_role = prom.query(
                    "sum by (job, role) (specdec_model_forward_duration_seconds_count)", at
                )
                assert {(r["metric"]["job"], r["metric"]["role"]) for r in by_role} == {
                    (JOBS["orchestrator"], "draft"),
                    (JOBS["orchestrator"], "target"),
                }, by_role

            # No rule fails to evaluate (bad vector matching shows up only here).
            for group in prom.api("rules")["groups"]:
                for rule in group["rules"]:
                    assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))

            # Each service's exposition passes promtool's linter.
            for role in (*stack.roles, "gateway"):
                text = gw.metrics_text() if role == "gateway" else stack.metrics_text(role)
                assert "specdec_build_info" in text, role
                res = _run([promtool, "check", "metrics"], input=text)
                assert res.returncode == 0 and not res.stdout.strip(), (
                    f"{role}: {res.stdout}{res.stderr}"
                )
        finally:
            prom.stop()


def test_metrics_answer_while_the_orchestrator_waits_for_the_services(tmp_path):
    """Prometheus scrapes pods before they are ready: /metrics answers from the
    start (a refused scrape is `up == 0`, which SpecdecServiceDown pages on), here
    while the orchestrator waits for a target nobody serves."""
    import signal

    from specdec.local.stack import spawn

    port, metrics_port = free_port(), free_port()
    overrides = [
        "draft.model=unused",
        "target.model=unused",
        f"orchestrator.port={port}",
        f"orchestrator.metrics_port={metrics_port}",
        f"orchestrator.target_address=127.0.0.1:{free_port()}",
        f"orchestrator.draft_address=127.0.0.1:{free_port()}",
        "orchestrator.connect_timeout_s=60",
    ]
    with open(tmp_path / "orchestrator.log", "wb") as out:
        proc = spawn("orchestrator", None, overrides, out=out)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                url = f"http://127.0.0.1:{metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "orchestrator.log").read_text()
                assert time.monotonic() < deadline, "no /metrics while connecting"
                time.sleep(0.2)
        assert "specdec_live_requests" in text
        assert proc.poll() is None  # still waiting for the services
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
