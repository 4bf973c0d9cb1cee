"""Kubernetes manifests (deploy/): every overlay renders, validates and is coherent.

Four overlays: demo and gpu run the three services (four Deployments with the
gateway); demo-one-process and gpu-one-process build on them with the
one-process component (the orchestrator loads both models, two Deployments).

Renders each kustomize overlay with ``kubectl kustomize``, validates every
built-in object with kubernetes-validate (strict, Kubernetes 1.30 schemas,
offline) and checks by assertion what schemas cannot: probes on declared
ports, resources, the restricted security context, Services/PDBs/HPA/
ServiceMonitor pointing at what exists, the ConfigMap's config.yaml loading
with specdec.config, the GPU scheduling. Skipped only when kubectl is absent.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
OVERLAYS = ("demo", "gpu", "demo-one-process", "gpu-one-process")
# A one-process overlay -> the three-service overlay it builds on.
ONE_PROCESS = {"demo-one-process": "demo", "gpu-one-process": "gpu"}
NAMESPACE = "specdec"
K8S_VERSION = "1.30.0"
COMPONENTS = ("draft", "target", "orchestrator", "gateway")
ONE_PROCESS_COMPONENTS = ("orchestrator", "gateway")
# Ports fixed by the project: (gRPC or HTTP, metrics) per component.
PORTS = {
    "orchestrator": (50050, 9100),
    "draft": (50051, 9101),
    "target": (50052, 9102),
    "gateway": (8000, 9103),
}
# The name of each component's serving port: the gateway speaks HTTP, the others gRPC.
SERVING_PORT = {"gateway": "http"}
IMAGES = {"demo": "specdec:cpu", "gpu": "specdec:cuda"}  # by the three-service overlay
# The gateway's own image (Dockerfile.cpu --target gateway), the same in every overlay.
GATEWAY_IMAGE = "specdec-gateway:0.1.0"
CONFIG_MOUNT = "/etc/specdec"
CUSTOM_GROUPS = ("monitoring.coreos.com/",)
UID = 10001

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not on PATH: cannot render the kustomize overlays"
)


# ---------------------------------------------------------------- helpers


@functools.cache
def _render(overlay: str) -> tuple:
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(REPO / "deploy" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert docs, f"overlay {overlay} rendered nothing"
    return tuple(docs)


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture
def objs(overlay) -> tuple:
    return _render(overlay)


def _of(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _one(objs, kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _components(overlay: str) -> tuple[str, ...]:
    return ONE_PROCESS_COMPONENTS if overlay in ONE_PROCESS else COMPONENTS


def _base(overlay: str) -> str:
    """The three-service overlay: itself, or the one a one-process overlay builds on."""
    return ONE_PROCESS.get(overlay, overlay)


def _model_pods(overlay: str) -> tuple[str, ...]:
    """The components whose pods load a model."""
    return ("orchestrator",) if overlay in ONE_PROCESS else ("draft", "target")


def _deployments(objs, overlay: str) -> dict[str, dict]:
    """component -> Deployment."""
    out = {}
    for d in _of(objs, "Deployment"):
        comp = d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        out[comp] = d
    assert set(out) == set(_components(overlay)), f"Deployments by component: {sorted(out)}"
    return out


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env") or []}


def _matches(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions)."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _pods_selected(objs, selector: dict) -> list[dict]:
    assert selector.get("matchLabels") or selector.get("matchExpressions"), "empty selector"
    return [
        d
        for d in _of(objs, "Deployment")
        if _matches(selector, d["spec"]["template"]["metadata"]["labels"])
    ]


_UNITS = {
    "m": 1e-3,
    "": 1,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def _quantity(q) -> float:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m and m.group(2) in _UNITS, f"unparsable quantity {q!r}"
    return float(m.group(1)) * _UNITS[m.group(2)]


def _container_ports(container: dict) -> dict:
    """name -> number and number -> number for the ports a container declares."""
    out = {}
    for p in container.get("ports") or []:
        out[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            out[p["name"]] = p["containerPort"]
    return out


def _probe_port(probe: dict):
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return handler, probe[handler]["port"]
    raise AssertionError(f"probe without a network handler: {probe}")


def _configs(objs) -> dict:
    """The specdec config (parsed YAML) of the rendered ConfigMap."""
    cm = _one(objs, "ConfigMap", "specdec-config")
    assert "config.yaml" in cm["data"], "ConfigMap specdec-config has no config.yaml"
    return yaml.safe_load(cm["data"]["config.yaml"])


def _pod_spec(d: dict) -> dict:
    return d["spec"]["template"]["spec"]


# ---------------------------------------------------------------- tests


def test_render_has_every_piece(objs, overlay):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    model_services = [
        ("Service", "specdec-draft"),
        ("Service", "specdec-target"),
        ("Service", "specdec-draft-headless"),
        ("Service", "specdec-target-headless"),
    ]
    for needed in [
        ("Namespace", NAMESPACE),
        ("ConfigMap", "specdec-config"),
        ("Service", "specdec-orchestrator"),
        *([] if overlay in ONE_PROCESS else model_services),
        ("Service", "specdec-orchestrator-headless"),
        ("Service", "specdec-gateway"),
        ("HorizontalPodAutoscaler", "specdec-orchestrator"),
        ("HorizontalPodAutoscaler", "specdec-gateway"),
        ("PrometheusRule", "specdec"),
    ]:
        assert needed in kinds, f"missing {needed[0]}/{needed[1]}"
    if overlay in ONE_PROCESS:  # nothing of the model services is left
        for kind, name in kinds:
            assert "draft" not in name and "target" not in name, f"{kind}/{name}"
    _deployments(objs, overlay)
    assert len(_of(objs, "PodDisruptionBudget")) == len(_components(overlay))
    assert _of(objs, "ServiceMonitor") or _of(objs, "PodMonitor")
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "duplicate objects"
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, (
                f"{o['kind']}/{o['metadata']['name']}"
            )


def test_schema_valid_k8s_1_30(objs):
    try:
        from kubernetes_validate.utils import ValidationError, validate
    except ImportError:  # pragma: no cover
        pytest.fail("kubernetes-validate missing: pip install -r requirements-dev.txt")
    errors = []
    for o in objs:
        if o["apiVersion"].startswith(CUSTOM_GROUPS):
            continue  # custom resources: checked by the assertions below
        try:
            validate(o, K8S_VERSION, strict=True)
        except ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            errors.append(f"{o['kind']}/{o['metadata']['name']} at {path}: {e.message}")
    assert not errors, "\n".join(errors)


def test_containers_probes_resources_security(objs, overlay):
    for comp, d in _deployments(objs, overlay).items():
        spec = _pod_spec(d)
        pod_sc = spec.get("securityContext") or {}
        assert spec.get("enableServiceLinks") is False, (
            f"{comp}: enableServiceLinks must be false (service links inject "
            "SPECDEC_<SVC>_PORT=tcp://... which the config loader reads as overrides)"
        )
        assert spec.get("topologySpreadConstraints") or (spec.get("affinity") or {}).get(
            "podAntiAffinity"
        ), f"{comp}: no topologySpreadConstraints / podAntiAffinity"
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        assert spec.get("containers"), comp
        for c in spec["containers"] + spec.get("initContainers", []):
            where = f"{comp}/{c['name']}"
            ports = _container_ports(c)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert kind in c, f"{where}: no {kind}"
                handler, port = _probe_port(c[kind])
                assert port in ports, f"{where}: {kind} port {port} not declared"
                if comp == "gateway":
                    # HTTP: ready = /health (orchestrator reachable), alive = /health/live.
                    path = "/health" if kind == "readinessProbe" else "/health/live"
                    assert handler == "httpGet", f"{where}: {kind} should be an HTTP probe"
                    assert c[kind]["httpGet"]["path"] == path, f"{where}: {kind} path"
                    assert ports[port] == ports["http"], f"{where}: {kind} not on the http port"
                else:
                    assert handler == "grpc", f"{where}: {kind} should use the gRPC health service"
            res = c.get("resources") or {}
            for key in ("cpu", "memory"):
                req, lim = res.get("requests", {}).get(key), res.get("limits", {}).get(key)
                assert req is not None and lim is not None, f"{where}: {key} request/limit"
                assert _quantity(req) <= _quantity(lim), f"{where}: {key} request > limit"
            sc = {**pod_sc, **(c.get("securityContext") or {})}
            assert sc.get("runAsNonRoot") is True, where
            assert sc.get("runAsUser") == UID, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert "ALL" in (sc.get("capabilities") or {}).get("drop", []), where
            assert (sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", where
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]["name"]], (
                f"{where}: needs an emptyDir at /tmp (read-only root filesystem)"
            )
            assert CONFIG_MOUNT in mounts, f"{where}: config not mounted at {CONFIG_MOUNT}"
            cfg_vol = volumes[mounts[CONFIG_MOUNT]["name"]]
            assert cfg_vol.get("configMap", {}).get("name") == "specdec-config", where
            assert f"{CONFIG_MOUNT}/config.yaml" in c.get("args", []) + c.get("command", []), where


def test_images_and_commands(objs, overlay):
    for comp, d in _deployments(objs, overlay).items():
        (c,) = _pod_spec(d)["containers"]
        image = GATEWAY_IMAGE if comp == "gateway" else IMAGES[_base(overlay)]
        assert c["image"] == image, f"{comp}: image {c['image']}"
        assert c.get("args", [])[:2] == ["serve", comp], f"{comp}: args {c.get('args')}"
        assert "command" not in c, f"{comp}: keep the image ENTRYPOINT (specdec)"


def test_graceful_termination_outlasts_drain(objs, overlay):
    cfg = _configs(objs)
    for comp, d in _deployments(objs, overlay).items():
        spec = _pod_spec(d)
        (c,) = spec["containers"]
        pre = c.get("lifecycle", {}).get("preStop")
        assert pre, f"{comp}: no preStop hook"
        if "sleep" in pre:
            sleep = pre["sleep"]["seconds"]
        else:
            cmd = pre["exec"]["command"]
            assert cmd[0] == "sleep", f"{comp}: preStop should sleep: {cmd}"
            sleep = float(cmd[1])
        drain = float(cfg[comp].get("grace_period_s", 10))
        tgps = spec.get("terminationGracePeriodSeconds", 30)
        assert tgps > sleep + drain, (
            f"{comp}: terminationGracePeriodSeconds {tgps} <= preStop {sleep} + drain {drain}"
        )


def test_config_loads_and_matches_manifests(objs, overlay):
    sys.path.insert(0, str(REPO))
    try:
        from specdec.config import config_from_dict
    finally:
        sys.path.remove(str(REPO))
    raw = _configs(objs)
    deps = _deployments(objs, overlay)
    # The orchestrator's config as its pod reads it: the file, then its environment.
    (orchestrator,) = _pod_spec(deps["orchestrator"])["containers"]
    cfg = config_from_dict(raw, env=_env(orchestrator))  # must not raise ConfigError
    assert cfg.orchestrator.local_models is (overlay in ONE_PROCESS), "orchestrator.local_models"
    for comp in _components(overlay):
        section = getattr(cfg, comp)
        assert section.host == "0.0.0.0", f"{comp}.host must be 0.0.0.0 in a pod"
        (c,) = _pod_spec(deps[comp])["containers"]
        ports = _container_ports(c)
        assert (section.port, section.metrics_port) == PORTS[comp], comp
        serving = SERVING_PORT.get(comp, "grpc")
        assert ports.get(serving) == section.port, f"{comp}: {serving} port != {comp}.port"
        assert ports.get("metrics") == section.metrics_port, f"{comp}: metrics port"
    services = {s["metadata"]["name"]: s for s in _of(objs, "Service")}
    wires = [("gateway", "orchestrator_address", "orchestrator")]
    if overlay not in ONE_PROCESS:
        wires += [
            ("orchestrator", "draft_address", "draft"),
            ("orchestrator", "target_address", "target"),
        ]
    for section, key, comp in wires:
        address = getattr(getattr(cfg, section), key).removeprefix("dns:///")
        host, port = address.rsplit(":", 1)
        name = host.split(".")[0]
        assert name in services, f"{section}.{key}: no Service {name}"
        assert int(port) in [p["port"] for p in services[name]["spec"]["ports"]], key
        assert _matches(
            {"matchLabels": services[name]["spec"]["selector"]},
            deps[comp]["spec"]["template"]["metadata"]["labels"],
        ), f"{section}.{key}: Service {name} does not select the {comp} pods"
    for comp in ("draft", "target"):
        section = getattr(cfg, comp)
        assert section.model.startswith("/"), f"{comp}.model must be absolute"
        # The pod that loads this model: its own, or the orchestrator's in one process.
        (pod,) = _model_pods(overlay) if overlay in ONE_PROCESS else (comp,)
        (c,) = _pod_spec(deps[pod])["containers"]
        if _base(overlay) == "gpu":
            assert (section.device, section.dtype) == ("cuda", "bfloat16"), comp
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
            assert "/models" in mounts and mounts["/models"].get("readOnly"), comp
            assert section.model.startswith("/models/"), comp
        else:
            assert section.device == "cpu", comp
            assert section.model.startswith("/app/models/demo/"), comp
            # The demo image bakes in models/demo from the repository.
            local = REPO / section.model[len("/app/") :]
            if (REPO / "models" / "demo").is_dir():
                assert local.is_dir(), f"{comp}.model {section.model}: {local} missing"


def test_services_select_pods_on_declared_ports(objs, overlay):
    deps = _of(objs, "Deployment")
    for s in _of(objs, "Service"):
        name = s["metadata"]["name"]
        selected = [
            d
            for d in deps
            if _matches(
                {"matchLabels": s["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"]
            )
        ]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} Deployments"
        (c,) = _pod_spec(selected[0])["containers"]
        ports = _container_ports(c)
        for p in s["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in ports, f"Service {name}: targetPort {target} not declared"
            assert ports[target] == p["port"], f"Service {name}: port {p['port']} != container port"
    for comp in _components(overlay):
        if comp == "gateway":
            continue
        h = _one(objs, "Service", f"specdec-{comp}-headless")
        assert h["spec"].get("clusterIP") == "None"
        assert h["spec"].get("publishNotReadyAddresses", False) is False


def test_pdbs_and_hpa_target_existing_deployments(objs):
    deps = {d["metadata"]["name"]: d for d in _of(objs, "Deployment")}
    covered = set()
    for pdb in _of(objs, "PodDisruptionBudget"):
        selected = _pods_selected(objs, pdb["spec"]["selector"])
        assert len(selected) == 1, f"PDB {pdb['metadata']['name']} selects {len(selected)}"
        covered.add(selected[0]["metadata"]["name"])
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])
    assert covered == set(deps), f"Deployments without a PDB: {set(deps) - covered}"
    for hpa in _of(objs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deps, ref
        assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
        assert "replicas" not in deps[ref["name"]]["spec"], (
            f"{ref['name']}: leave replicas to the HPA"
        )
        (c,) = _pod_spec(deps[ref["name"]])["containers"]
        for m in hpa["spec"].get("metrics", []):
            if m["type"] == "Resource":
                assert m["resource"]["name"] in c["resources"]["requests"], "HPA needs requests"


def test_monitoring_selects_metrics_ports(objs, overlay):
    services = _of(objs, "Service")
    scraped = set()
    for sm in _of(objs, "ServiceMonitor"):
        selected = [
            s for s in services if _matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))
        ]
        assert selected, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
        for ep in sm["spec"]["endpoints"]:
            assert "port" in ep, "endpoints should use named ports"
            for s in selected:
                names = [p.get("name") for p in s["spec"]["ports"]]
                assert ep["port"] in names, (
                    f"Service {s['metadata']['name']} lacks port {ep['port']}"
                )
                scraped.add(s["spec"]["selector"]["app.kubernetes.io/component"])
    for pm in _of(objs, "PodMonitor"):
        selected = _pods_selected(objs, pm["spec"]["selector"])
        assert selected, f"PodMonitor {pm['metadata']['name']} selects no pods"
        for ep in pm["spec"]["podMetricsEndpoints"]:
            for d in selected:
                (c,) = _pod_spec(d)["containers"]
                assert ep["port"] in _container_ports(c), f"{d['metadata']['name']}: {ep['port']}"
                scraped.add(
                    d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                )
    assert scraped == set(_components(overlay)), f"scraped components: {sorted(scraped)}"


def test_prometheus_rule(objs, tmp_path):
    rule = _one(objs, "PrometheusRule", "specdec")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert groups, "PrometheusRule has no groups"
    for g in groups:
        assert g.get("name") and g.get("rules"), g
        for r in g["rules"]:
            assert ("record" in r) != ("alert" in r) and r.get("expr"), r
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # CI installs Debian's prometheus package for this part
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_dashboard_configmap(objs):
    cms = [
        c
        for c in _of(objs, "ConfigMap")
        if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(cms) == 1, "expected one ConfigMap labelled grafana_dashboard=1"
    files = {k: v for k, v in cms[0]["data"].items() if k.endswith(".json")}
    assert files, "dashboard ConfigMap holds no .json"
    for name, text in files.items():
        assert json.loads(text).get("title"), f"{name}: dashboard without a title"


def test_gpu_scheduling(objs, overlay):
    deps = _deployments(objs, overlay)
    if _base(overlay) != "gpu":
        for d in deps.values():
            for c in _pod_spec(d)["containers"]:
                for part in ("requests", "limits"):
                    assert "nvidia.com/gpu" not in c["resources"].get(part, {}), (
                        "demo must not need GPUs"
                    )
        return
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in _of(objs, "HorizontalPodAutoscaler")}
    pvc_names = {p["metadata"]["name"] for p in _of(objs, "PersistentVolumeClaim")}
    pools = {}
    for comp in _model_pods(overlay):
        spec = _pod_spec(deps[comp])
        (c,) = spec["containers"]
        req = c["resources"]["requests"].get("nvidia.com/gpu")
        lim = c["resources"]["limits"].get("nvidia.com/gpu")
        assert req is not None and str(req) == str(lim), (
            f"{comp}: nvidia.com/gpu requests {req} limits {lim}"
        )
        assert int(lim) >= 1
        # The CUDA image's NVIDIA_VISIBLE_DEVICES=void hides the GPUs from a pod.
        assert _env(c).get("NVIDIA_VISIBLE_DEVICES") != "void", f"{comp}: GPUs hidden"
        node_affinity = (spec.get("affinity") or {}).get("nodeAffinity")
        assert spec.get("nodeSelector") or node_affinity, f"{comp}: no nodeSelector/nodeAffinity"
        pools[comp] = json.dumps([spec.get("nodeSelector"), node_affinity], sort_keys=True)
        tolerated = {t.get("key") for t in spec.get("tolerations") or []}
        assert "nvidia.com/gpu" in tolerated, f"{comp}: no toleration for nvidia.com/gpu"
        name = deps[comp]["metadata"]["name"]
        replicas = hpas[name]["spec"]["minReplicas"] if name in hpas else None
        replicas = replicas or deps[comp]["spec"].get("replicas", 1)
        assert replicas >= 2, f"{comp}: replicas"
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert claims, f"{comp}: models should come from a PersistentVolumeClaim"
        for v in claims:
            assert v["persistentVolumeClaim"]["claimName"] in pvc_names, v
    if overlay in ONE_PROCESS:  # both models on one GPU, on the large-GPU pool
        assert "target-gpu" in pools["orchestrator"], pools
    else:
        assert pools["draft"] != pools["target"], "draft and target should use different pools"
    for comp in set(deps) - set(_model_pods(overlay)):
        for c in _pod_spec(deps[comp])["containers"]:
            assert "nvidia.com/gpu" not in c["resources"]["limits"], f"{comp} needs no GPU"


def _startup_budget(deployment: dict) -> float:
    probe = _pod_spec(deployment)["containers"][0]["startupProbe"]
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_startup_budgets_outlast_what_each_pod_waits_for(objs, overlay):
    """The orchestrator serves once a target answers and a draft too (or DRAFT_WAIT_S
    more have passed): its connect_timeout_s must outlast their startup budgets (or
    it exits and crash-loops while a GPU model loads), and its own startup probe
    must outlast that wait (or it is killed while it waits). In one process it
    loads the draft, then the target, before it serves: its startup probe must
    allow as long as the two model pods of the overlay it builds on allow."""
    from orchestrator.engine import DRAFT_WAIT_S

    cfg = _configs(objs)
    deps = _deployments(objs, overlay)
    if overlay in ONE_PROCESS:
        base = _base(overlay)
        services = _deployments(_render(base), base)
        loads = _startup_budget(services["draft"]) + _startup_budget(services["target"])
        assert _startup_budget(deps["orchestrator"]) >= loads, (
            _startup_budget(deps["orchestrator"]),
            loads,
        )
        return

    def budget(comp: str) -> float:
        return _startup_budget(deps[comp])

    connect = float(cfg["orchestrator"].get("connect_timeout_s", 120))
    services = max(budget("draft"), budget("target"))
    assert connect >= services, f"connect_timeout_s {connect} < the services' startup {services}"
    wait = connect + min(connect, DRAFT_WAIT_S)
    assert budget("orchestrator") > wait, (budget("orchestrator"), wait)


def test_gpu_rollouts_need_no_spare_gpu(objs, overlay):
    """A pool with one GPU per pod has none for a surge pod: the pods that load a
    model roll by replacing a pod in place (the PodDisruptionBudget allows one down)."""
    if _base(overlay) != "gpu":
        return
    deps = _deployments(objs, overlay)
    for comp in _model_pods(overlay):
        rolling = deps[comp]["spec"]["strategy"]["rollingUpdate"]
        assert rolling == {"maxSurge": 0, "maxUnavailable": 1}, (comp, rolling)


def test_liveness_probes_ask_what_stays_up_while_draining(objs, overlay):
    """Readiness may turn down on SIGTERM; liveness must not, or a long drain is cut
    short by the kubelet: the gRPC services' liveness asks Health's "liveness"
    (SERVING while the process serves), the gateway's /health/live."""
    for comp, d in _deployments(objs, overlay).items():
        (c,) = _pod_spec(d)["containers"]
        probe = c["livenessProbe"]
        if comp == "gateway":
            assert probe["httpGet"]["path"] == "/health/live", probe
        else:
            assert probe["grpc"].get("service") == "liveness", (comp, probe)


@pytest.mark.skipif(
    not (REPO / "models" / "demo").is_dir(), reason="the demo pair (models/demo) is not here"
)
def test_the_demo_one_process_pod_serves_the_demo_pair(tmp_path):
    """What a demo-one-process orchestrator pod runs, run here: its rendered
    config.yaml (the demo image's /app paths mapped to this checkout, loopback
    ports) and its container's environment, as a real process. It serves alone
    (local_models from the environment: no draft or target to wait for), greedy
    output comes back through the public API, and its one metrics endpoint
    carries the three build infos the dashboard and alerts join on."""
    from specdec.local.stack import Stack, free_port, spawn, wait_healthy

    overlay = "demo-one-process"
    objs = _render(overlay)
    (c,) = _pod_spec(_deployments(objs, overlay)["orchestrator"])["containers"]
    assert c["args"] == ["serve", "orchestrator", "--config", f"{CONFIG_MOUNT}/config.yaml"]
    raw = _configs(objs)
    for comp in ("draft", "target"):
        raw[comp]["model"] = str(REPO / raw[comp]["model"].removeprefix("/app/"))
    raw["orchestrator"].update(host="127.0.0.1", port=free_port(), metrics_port=free_port())
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**_env(c), "PYTHONPATH": str(REPO)}
    with open(tmp_path / "orchestrator.log", "wb") as log:
        proc = spawn("orchestrator", str(path), [], log, {**os.environ, **env})
    stack = Stack(path, {**raw, "orchestrator": {**raw["orchestrator"], "local_models": True}})
    stack.procs = [proc]
    try:
        wait_healthy(stack.orchestrator_address, 120, [proc])
        text = stack.generate("Once upon a time", max_new_tokens=16, temperature=0.0, gamma=4)
        assert text.strip(), text
        exposition = stack.metrics_text("orchestrator")
        build = re.findall(r'specdec_build_info\{[^}]*role="(\w+)"', exposition)
        assert sorted(build) == ["draft", "orchestrator", "target"], build
    except BaseException:
        print((tmp_path / "orchestrator.log").read_text()[-4000:])
        raise
    finally:
        stack.stop()
