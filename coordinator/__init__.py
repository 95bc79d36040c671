"""Redis-backed load coordination for fleets of stateless LLM inference proxy nodes."""

from __future__ import annotations

from coordinator.coordinator import Coordinator, RegisterResult
from coordinator.errors import (
    CoordinationUnavailableError,
    CoordinatorError,
    EpochFencedError,
    InvalidArgumentError,
    NoInstanceError,
    PoolFullError,
    ScriptArgumentError,
    UnknownInstanceError,
)
from coordinator.models import InstanceLoad, InstanceSpec, RequestShape, Reservation
from coordinator.settings import Settings, Weights
from coordinator.snapshot import Snapshot
from coordinator.strategies import Ranking, Score

__all__ = [
    "CoordinationUnavailableError",
    "Coordinator",
    "CoordinatorError",
    "EpochFencedError",
    "InstanceLoad",
    "InstanceSpec",
    "InvalidArgumentError",
    "NoInstanceError",
    "PoolFullError",
    "Ranking",
    "RegisterResult",
    "RequestShape",
    "Reservation",
    "Score",
    "ScriptArgumentError",
    "Settings",
    "Snapshot",
    "UnknownInstanceError",
    "Weights",
]
