"""A mock OpenAI-compatible inference engine whose timing is the shared EngineModel.

- `config`: its settings and the flag/environment table;
- `engine`: the engine model in real time, its metrics and fault draws;
- `http`: the OpenAI-compatible HTTP app and how to run it.
"""

from __future__ import annotations

from local_fleet.mock_engine.config import MockEngineConfig, add_arguments, config_from_args
from local_fleet.mock_engine.http import (
    RunningMockEngine,
    create_app,
    main,
    run,
    serve,
    start_mock_engine,
)

__all__ = [
    "MockEngineConfig",
    "RunningMockEngine",
    "add_arguments",
    "config_from_args",
    "create_app",
    "main",
    "run",
    "serve",
    "start_mock_engine",
]
