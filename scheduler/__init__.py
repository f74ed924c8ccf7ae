"""The scheduler loop, a small torch model, rpc methods, and the ``Engine`` facade."""

from scheduler.admission import Limits
from scheduler.async_engine import AsyncEngine, AsyncRequest
from scheduler.engine import Engine
from scheduler.errors import (
    EngineClosed,
    EngineError,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    SchedulerGone,
)
from scheduler.handles import GenerateResult, RequestHandle, StreamChunk
from scheduler.handshake import HelloReply, hello
from scheduler.loop import Scheduler, SchedulerStats
from scheduler.model import ModelConfig, StubLM, TinyLM, build_model
from scheduler.rpc_methods import RpcMethods
from scheduler.wiring import Endpoints, serve_ring, serve_zmq

__all__ = [
    "AsyncEngine",
    "AsyncRequest",
    "Endpoints",
    "Engine",
    "EngineClosed",
    "EngineError",
    "GenerateResult",
    "HelloReply",
    "InvalidRequest",
    "Limits",
    "ModelConfig",
    "Overloaded",
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
    "hello",
    "serve_ring",
    "serve_zmq",
]
