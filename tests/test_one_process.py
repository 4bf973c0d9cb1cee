"""One process (``orchestrator.local_models``): the public API with both models
loaded into the orchestrator and called through the in-process ports. The
engine and its exactness are the ones the in-process tests prove; these tests
prove the served mode: a real ``specdec serve orchestrator`` process, the
target's own greedy output, one process and no hop, the models' metrics on the
orchestrator's endpoint, and a clean error for a model that is not there."""

from __future__ import annotations

import pytest

from specdec.config import load_config
from specdec.runtime.loading import load_tokenizer
from specdec.sampling import SamplingParams

from .conftest import WIRE_TOP_K
from .stack import local_stack, set_args, specdec_command
from .test_greedy import reference
from .test_statistical import check


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, llama_pair):
    draft, target = llama_pair
    with local_stack(
        tmp_path_factory.mktemp("one-process"),
        draft,
        target,
        orchestrator__local_models=True,
        orchestrator__wire_top_k=WIRE_TOP_K,  # (q truncated as the statistical test's theory)
        target__torch_threads=2,
    ) as stack:
        yield stack


def test_one_process_runs_no_model_service(one_process):
    assert [p.poll() for p in one_process.procs] == [None]  # the orchestrator alone
    assert one_process.proc("orchestrator") is one_process.procs[0]


def test_greedy_in_one_process_equals_target_generate(one_process, llama_pair):
    _, target = llama_pair
    tok = load_tokenizer(str(target))
    for prompt in ("the cat sat on", "a"):
        ids = tok.encode(prompt)
        want = reference(target, ids, 32)
        for fields in ({"gamma": 1}, {"gamma": 4}, {"gamma": 0}, {}):
            got, _, stats = one_process.generate_raw(
                prompt=ids, max_new_tokens=32, temperature=0.0, **fields
            )
            assert got == want, (prompt, fields)
            if fields.get("gamma"):  # (adaptive may choose plain decoding)
                assert stats.drafted_tokens > 0
            assert stats.wire_bytes_per_token == 0  # no wire: q is handed over unpacked


def test_no_step_drafts_ahead_in_one_process(one_process):
    """Both models' passes share one event loop: a request's overlap is ignored."""
    for temperature in (0.0, 1.0):
        _, _, stats = one_process.generate_raw(
            prompt="overlap", max_new_tokens=24, temperature=temperature, gamma=3, overlap=True
        )
        assert stats.drafted_tokens > 0 and stats.overlapped_steps == 0


def test_a_seeded_sampled_request_repeats_in_one_process(one_process):
    runs = [
        one_process.generate_raw(
            prompt="seeded",
            max_new_tokens=24,
            temperature=1.0,
            top_k=20,
            top_p=0.9,
            seed=7,
            gamma=3,
        )[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 24


@pytest.mark.slow
def test_sampled_tokens_in_one_process_follow_target_distribution(one_process, llama_pair):
    """The statistical test of the services, on concurrent requests (batched passes)
    with top-k and top-p, against the target's exact marginals."""
    params = SamplingParams(1.0, top_k=12, top_p=0.9)
    for name, (dist, threshold) in check(one_process, llama_pair, params).items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


def test_the_orchestrator_exposes_both_models_metrics(one_process):
    one_process.generate_raw(prompt="metrics", max_new_tokens=8, temperature=0.0, gamma=2)
    forward = "specdec_model_forward_duration_seconds_count"
    for role in ("draft", "target"):
        assert one_process.metric("orchestrator", forward, f'role="{role}"') > 0
    assert one_process.metric("orchestrator", "specdec_generated_tokens_total") >= 8


def test_up_does_not_wire_model_services_it_does_not_start():
    from specdec.cli import _unwired

    cfg = load_config(None, ["draft.port=1", "target.port=2", "orchestrator.local_models=true"])
    assert _unwired(cfg) == ""
    cfg = load_config(None, ["draft.port=1", "target.port=2"])
    assert "orchestrator.draft_address" in _unwired(cfg)


def test_a_missing_target_model_is_a_config_error_naming_the_key(tmp_path):
    proc = specdec_command(
        "serve",
        "orchestrator",
        *set_args(
            [
                "orchestrator.local_models=true",
                "orchestrator.port=0",
                "orchestrator.metrics_port=0",
                f"target.model={tmp_path / 'nowhere'}",
            ]
        ),
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "target.model" in err
