"""The config loader: defaults, overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from specdec.config import ConfigError, config_from_dict, load_config

BASE = {"draft": {"model": "d"}, "target": {"model": "t"}}


def test_default_config_loads_and_points_at_the_demo_pair():
    cfg = load_config()
    assert cfg.draft.model.endswith("models/demo/draft")
    assert cfg.target.model.endswith("models/demo/target")
    assert cfg.orchestrator.gamma <= cfg.orchestrator.max_gamma


def test_the_local_config_gives_each_model_service_one_thread():
    """configs/default.yaml runs all the services on one machine: a second target
    thread waits for the core the draft holds, and speculation under concurrent load
    lost a third of its tokens/s that way (docs/benchmarks.md, "Threads under load").
    Passes of plain decoding steps alone, for which the draft is idle, take both
    cores ("A second thread for plain passes")."""
    cfg = load_config(env={})
    assert (cfg.draft.torch_threads, cfg.target.torch_threads) == (1, 1)
    assert cfg.target.plain_torch_threads == 2 and cfg.draft.plain_torch_threads == 0


@pytest.mark.parametrize(
    "raw,key",
    [
        ({**BASE, "draft": {"model": "d", "prot": 1}}, "draft.prot"),
        ({**BASE, "bogus": {}}, "bogus"),
        ({**BASE, "target": {"model": "t", "device": "tpu"}}, "target.device"),
        ({**BASE, "target": {"model": "t", "dtype": "int8"}}, "target.dtype"),
        ({**BASE, "draft": {"model": "d", "port": "eighty"}}, "draft.port"),
        ({**BASE, "draft": {"model": "d", "port": 70000}}, "draft.port"),
        ({**BASE, "orchestrator": {"gamma": 20}}, "orchestrator.gamma"),
        ({**BASE, "orchestrator": {"max_new_tokens": 0}}, "orchestrator.max_new_tokens"),
        ({**BASE, "orchestrator": {"keepalive_s": 0.5}}, "orchestrator.keepalive_s"),
        ({**BASE, "gateway": {"keepalive_s": 0}}, "gateway.keepalive_s"),
        ({**BASE, "draft": {"model": "d", "relay_keepalive_s": 0}}, "draft.relay_keepalive_s"),
        ({**BASE, "target": {"model": "t", "keep_freed_mb": 4096}}, "target.keep_freed_mb"),
        ({**BASE, "draft": {"model": "d", "pad_vocab": 64, "hidden_q": True}}, "draft.pad_vocab"),
        ({**BASE, "draft": {"model": "d", "pad_vocab": -1}}, "draft.pad_vocab"),
        ({**BASE, "target": {"model": "t", "pad_vocab": 64}}, "target.pad_vocab"),
        ({**BASE, "draft": {"model": "d", "plain_torch_threads": 2}}, "draft.plain_torch_threads"),
        (
            {**BASE, "target": {"model": "t", "plain_torch_threads": -1}},
            "target.plain_torch_threads",
        ),
        ({**BASE, "draft": {"model": "d", "tls": "x"}}, "draft.tls"),
        ({"draft": {"model": "d"}, "target": {}}, "target.model"),
        (
            {**BASE, "draft": {"model": "d", "trust_remote_code": "maybe"}},
            "draft.trust_remote_code",
        ),
    ],
)
def test_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, env={})
    assert str(err.value).startswith(key + ":"), str(err.value)


def test_env_and_flags_override_in_order():
    env = {
        "SPECDEC_TARGET_DEVICE": "cuda",
        "SPECDEC_ORCHESTRATOR_GAMMA": "2",
        "SPECDEC_DRAFT_TLS__CA": "/ca.pem",
        # Kubernetes service links share the prefix and are ignored.
        "SPECDEC_DRAFT_PORT": "tcp://10.0.0.1:50051",
        "SPECDEC_DRAFT_SERVICE_HOST": "10.0.0.1",
    }
    cfg = config_from_dict(BASE, ["orchestrator.gamma=3"], env=env)
    assert cfg.target.device == "cuda"
    assert cfg.orchestrator.gamma == 3  # the flag wins over the environment
    assert cfg.draft.tls.ca == "/ca.pem"
    assert cfg.draft.port == 50051  # the default, not the service link


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("draft: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_a_device_this_machine_lacks_is_a_config_error_naming_the_key(tmp_path):
    """The config checks a device's kind (cpu or cuda); a service checks, before it
    loads anything, that the machine has it, and names the key if not. (Before, a
    missing GPU or index failed deep in loading with torch's own message.)"""
    import torch

    from specdec.config import ConfigError, ModelServiceConfig
    from specdec.model_service import ModelService
    from specdec.runtime.loading import check_device

    check_device("draft.device", "cpu")
    missing = torch.cuda.device_count()  # an index this machine does not have
    for device in ("cuda:x", f"cuda:{missing}") + (() if torch.cuda.is_available() else ("cuda",)):
        with pytest.raises(ConfigError, match=r"^target\.device: "):
            check_device("target.device", device)
    with pytest.raises(ConfigError, match=r"^draft\.device: "):
        ModelService("draft", ModelServiceConfig(model=str(tmp_path), device=f"cuda:{missing}"))


def test_env_overrides_keep_our_urls_and_skip_service_links():
    """Kubernetes service links share the prefix (SPECDEC_DRAFT_PORT=tcp://...) and
    are skipped; a dns:/// address of ours is not (it was, for its "://")."""
    env = {
        "SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS": "dns:///draft.example:50051",
        "SPECDEC_DRAFT_PORT": "tcp://10.0.0.1:50051",
    }
    cfg = config_from_dict(BASE, env=env)
    assert cfg.orchestrator.draft_address == "dns:///draft.example:50051"
    assert cfg.draft.port == config_from_dict(BASE, env={}).draft.port


def test_a_missing_local_model_directory_is_named_at_once():
    from specdec.runtime.loading import check_model_path

    for path in ("models/demo/draftt", "./nope", "/no/such/model"):
        with pytest.raises(ConfigError, match="draft.model: no such model directory"):
            check_model_path("draft.model", path)
    check_model_path("draft.model", "Qwen/Qwen2.5-0.5B")  # a hub id: left to the loader
