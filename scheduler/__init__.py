"""The scheduler loop, a small torch model, rpc methods, and the ``Engine`` facade."""

from scheduler.core.admission import Limits
from scheduler.core.loop import Scheduler, SchedulerStats
from scheduler.core.rpc_methods import RpcMethods
from scheduler.engine.async_engine import AsyncEngine, AsyncRequest
from scheduler.engine.engine import Engine
from scheduler.engine.handles import GenerateResult, RequestHandle, Stream, StreamChunk
from scheduler.errors import (
    EngineClosed,
    EngineError,
    EngineForked,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    SchedulerGone,
)
from scheduler.handshake import HelloReply, hello
from scheduler.launch.wiring import Endpoints, serve_ring, serve_zmq
from scheduler.models.files import ModelLoadError
from scheduler.models.loading import HFModelSpec
from scheduler.models.protocol import Model, PromptChunk
from scheduler.models.tiny import ModelConfig, StubLM, TinyLM, build_model

__all__ = [
    "AsyncEngine",
    "AsyncRequest",
    "Endpoints",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineForked",
    "GenerateResult",
    "HFModelSpec",
    "HelloReply",
    "InvalidRequest",
    "Limits",
    "Model",
    "ModelConfig",
    "ModelLoadError",
    "Overloaded",
    "PromptChunk",
    "RequestFailed",
    "RequestHandle",
    "RpcMethods",
    "Scheduler",
    "SchedulerGone",
    "SchedulerStats",
    "Stream",
    "StreamChunk",
    "StubLM",
    "TinyLM",
    "build_model",
    "hello",
    "serve_ring",
    "serve_zmq",
]
