"""Every server answers the standard health service and lists its services by reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.v1 import orchestrator_pb2

SERVICES = {
    "draft": "specdec.v1.DraftService",
    "target": "specdec.v1.TargetService",
    "orchestrator": "specdec.v1.Orchestrator",
}


@pytest.mark.parametrize("role", list(SERVICES))
def test_health_and_reflection(llama_stack, role):
    address = (
        llama_stack.orchestrator_address if role == "orchestrator" else llama_stack.address(role)
    )
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICES[role]):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICES[role], "grpc.health.v1.Health"} <= names


def test_orchestrator_info(llama_stack):
    from specdec.v1 import orchestrator_pb2_grpc

    with grpc.insecure_channel(llama_stack.orchestrator_address) as ch:
        info = orchestrator_pb2_grpc.OrchestratorStub(ch).Info(
            orchestrator_pb2.OrchestratorInfoRequest(), timeout=5
        )
    assert info.vocab_size > 0 and info.max_gamma >= info.default_gamma
    assert info.draft_model_id and info.target_model_id
