"""The scheduler loop, a small torch model, rpc methods, and the ``Engine`` facade."""

from scheduler.engine import Engine, GenerateResult, RequestHandle, StreamChunk
from scheduler.errors import EngineClosed, EngineError, RequestFailed, SchedulerGone
from scheduler.loop import Scheduler, SchedulerStats
from scheduler.model import ModelConfig, StubLM, TinyLM, build_model
from scheduler.rpc_methods import RpcMethods
from scheduler.wiring import Endpoints, serve_ring, serve_zmq

__all__ = [
    "Endpoints",
    "Engine",
    "EngineClosed",
    "EngineError",
    "GenerateResult",
    "ModelConfig",
    "RequestFailed",
    "RequestHandle",
    "RpcMethods",
    "Scheduler",
    "SchedulerGone",
    "SchedulerStats",
    "StreamChunk",
    "StubLM",
    "TinyLM",
    "build_model",
    "serve_ring",
    "serve_zmq",
]
