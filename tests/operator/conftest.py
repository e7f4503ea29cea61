"""Shared builders for the operator's unit tests: pure functions only, no Kubernetes API."""

from __future__ import annotations

import pytest

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.workload import Decision, Owner


@pytest.fixture
def owner() -> Owner:
    return Owner(name="chat", namespace="team-a", uid="0b5c-uid")


@pytest.fixture
def config() -> OperatorConfig:
    return OperatorConfig(default_image="flotilla-engine:test")


@pytest.fixture
def decision() -> Decision:
    return Decision(tenant="team-a", replicas=2)


def _make_spec(**overrides) -> InferenceServiceSpec:
    wire = {
        "model": {"uri": "file:///models/tiny-llama", "servedName": "tiny-llama"},
        "resources": {"gpus": 1, "gpuType": "h100"},
        "replicas": 2,
    }
    wire.update(overrides)
    return InferenceServiceSpec.model_validate(wire)


@pytest.fixture
def make_spec():
    """Build a spec: the DESIGN.md example with fields replaced by camelCase overrides."""
    return _make_spec
