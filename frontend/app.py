"""The ASGI app: routes, the engine's lifetime, and every answer that is not generation.

``Frontend(settings, tokenizer)`` is an ASGI 3 application. Its lifespan
starts the :class:`~scheduler.AsyncEngine` (and the rpc door, when an
endpoint is given) on the server's event loop and closes them at shutdown. Routes::

    POST /v1/completions        frontend.generate
    POST /v1/chat/completions   frontend.generate
    POST /v1/embeddings         unit-norm vectors (float lists or base64)
    GET  /v1/models             the model, under each name it is served as
    GET  /health                200 while the scheduler answers, 503 once it is gone
    GET  /metrics               the scheduler's families, then the HTTP ones

Each GET route answers HEAD as GET without the body (a load balancer's
``HEAD /health``). Every answer carries ``x-request-id`` (the client's, else one
made). Every error is OpenAI's shape (:mod:`frontend.errors`); a body past
``max_body_bytes`` is a 413 before it is read, and one not read whole
``body_timeout`` seconds after its headers is a 408 (slowloris); a client
that leaves aborts its request (:class:`~frontend.asgi.Conn`). Once the
scheduler is gone, ``/health`` and requests are 503, and the rpc door answers
each call at once with a failure (:mod:`frontend.rpc_door`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from bus import SocketOptions
from frontend.asgi import (
    JSON,
    PIECE,
    TEXT,
    WATCH_AFTER_S,
    WHOLE,
    Conn,
    Disconnected,
    Receive,
    Reply,
    Scope,
    Send,
    read_body,
    request_id,
    send_bytes,
    send_failure,
)
from frontend.chat import ChatTemplate
from frontend.errors import ApiError, bad_request, clip, from_engine
from frontend.generate import OpenAIServing
from frontend.metrics import HttpMetrics
from frontend.rpc_door import RpcDoor
from frontend.sampling import SamplingTranslator
from frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    decode,
    encode,
)
from frontend.tokenizer import Tokenizer
from frontend.turns import Turns, loop_turns
from messages import BusError
from scheduler import (
    AsyncEngine,
    EngineError,
    HFModelSpec,
    Limits,
    ModelConfig,
    SchedulerGone,
)
from scheduler.dp import Policy

__all__ = ["Frontend", "Settings"]

T = TypeVar("T")

log = logging.getLogger("frontend")

#: The default bound on a request body (bytes): 4 MiB, a 1M-token prompt as ids.
MAX_BODY_BYTES = 4 << 20
#: The default deadline (seconds) for reading a request body whole, from its headers on.
BODY_TIMEOUT_S = 30.0
#: Seconds a stream cancelled by the server's shutdown may take to write its last
#: event (a client that is not reading gets none, rather than hold the exit).
CUT_SHORT_S = 1.0
#: Seconds ``/health`` and ``/metrics`` wait for the scheduler's answer before a 503.
RPC_WAIT_S = 5.0
#: Seconds the engine's shutdown rpc, then its processes, get at shutdown (then killed).
ENGINE_CLOSE_S = 5.0


@dataclass(frozen=True, slots=True)
class Settings:
    """How the server runs: the engine's mode and limits, the model, the HTTP bounds.

    Attributes:
        max_body_bytes: a request body past this is answered 413.
        body_timeout: seconds from a request's headers to its whole body, then a 408
            (counted): a client that dribbles its body does not hold a handler.
        rpc_endpoint: where the rpc door listens (``ipc://DIR/rpc``, ``tcp://``; None: no door).
        rpc_options, curve_clients: the door's socket options and the CURVE
            public keys it admits (None: no CURVE).
        run_dir: a directory made for this server (its door's), removed at close.
        dp_policy: how the dispatcher picks a replica when ``dp_size`` is above 1.
        model_name: the name answers report (``--served-model-name``'s first).
        model_aliases: other names a request may give (``/v1/models`` lists them all).
        pd: ``(P, D)``: prefill and decode apart (``Engine(pd=...)``; ``zmq`` mode).
    """

    mode: Literal["ring", "zmq"] = "ring"
    model: ModelConfig | HFModelSpec = field(default_factory=ModelConfig)
    model_name: str = "tiny"
    model_aliases: tuple[str, ...] = ()
    max_batch: int = 64
    tp_size: int = 1
    dp_size: int = 1
    dp_policy: Policy = "least_loaded"
    limits: Limits = field(default_factory=Limits)
    metrics: bool = True
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = BODY_TIMEOUT_S
    default_max_tokens: int = 256
    rpc_endpoint: str | None = None
    rpc_options: SocketOptions = field(default_factory=SocketOptions)
    curve_clients: list[bytes] | None = None
    run_dir: str | None = None
    pd: tuple[int, int] | None = None


Handler = Callable[[Scope, Receive, Reply, float], Awaitable[int]]


def _engine(s: Settings) -> AsyncEngine:
    """The engine ``s`` describes (not started)."""
    return AsyncEngine(s.mode, s.model, max_batch=s.max_batch, tp_size=s.tp_size,
                       dp_size=s.dp_size, dp_policy=s.dp_policy, limits=s.limits,
                       metrics=s.metrics, pd=s.pd)


async def _max_model_len(engine: AsyncEngine) -> int:
    """The scheduler's bound on a request's prompt and answer together: the model's
    context where it has one, else what admission would ever queue (``model_info``).

    Raises:
        SchedulerGone, RpcTimeout: the scheduler does not answer.
        RuntimeError: its answer is a failure or not a ``model_info`` result.
    """
    reply = await engine.collective_rpc("model_info", timeout=30.0)
    result = reply.result
    longest = result.get("max_prompt_tokens") if isinstance(result, dict) else None
    if isinstance(longest, list):  # tensor parallel: each rank's
        ranks = [n for n in longest if isinstance(n, int)]
        longest = min(ranks) if ranks and len(ranks) == len(longest) else None
    if not reply.success or not isinstance(longest, int):
        raise RuntimeError(f"the scheduler's model_info: {reply.message or result!r}")
    return longest


class Frontend:
    """The OpenAI-compatible ASGI application (see the module docstring).

    ``engine`` builds the (unstarted) engine from the settings; the default
    builds :class:`~scheduler.AsyncEngine` from them. A subclass of it may
    stand in (tests script its tokens).
    """

    def __init__(self, settings: Settings, tokenizer: Tokenizer, *,
                 engine: Callable[[Settings], AsyncEngine] | None = None,
                 template: ChatTemplate | None = None) -> None:
        self.settings = settings
        self._make_engine = engine or _engine
        self.tokenizer = tokenizer
        #: Compiled here (unless given), so a template that does not compile stops the
        #: server before its engine starts (raises TokenizerError).
        self.template = template or ChatTemplate(tokenizer)
        self.metrics = HttpMetrics() if settings.metrics else None
        self.engine: AsyncEngine | None = None
        self.door: RpcDoor | None = None
        #: The most tokens a request's prompt and answer may hold (known once started).
        self.max_model_len: int | None = None
        self._gen: OpenAIServing | None = None
        self._gone = False
        #: The serving loop's turns, once started (a lookup per request is a getpid).
        self._turns: Turns | None = None
        self._lag: asyncio.Task[None] | None = None
        self._started = int(time.time())
        self._routes: dict[tuple[str, str], tuple[str, Handler]] = {
            ("POST", "/v1/completions"): ("completions", self._completions),
            ("POST", "/v1/chat/completions"): ("chat", self._chat),
            ("POST", "/v1/embeddings"): ("embeddings", self._embeddings),
            ("GET", "/v1/models"): ("models", self._models),
            ("GET", "/health"): ("health", self._health),
        }
        for name in (settings.model_name, *settings.model_aliases):
            self._routes[("GET", f"/v1/models/{name}")] = ("models", self._model)
        # A path turned off is not there, for any method (not a 405 naming GET).
        self._off = {} if settings.metrics else {"/metrics": "metrics are off (--no-metrics)"}
        if settings.metrics:
            self._routes[("GET", "/metrics")] = ("metrics", self._metrics)
        # HEAD is GET without the body: a load balancer's health check often sends it.
        self._routes.update({("HEAD", path): route for (method, path), route
                             in list(self._routes.items()) if method == "GET"})
        # Each path's methods, for a 405's Allow header.
        self._allowed = {path: ", ".join(sorted(m for m, p in self._routes if p == path))
                       for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- lifetime ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine (and the rpc door) on the running loop; once started, nothing
        (``python -m frontend`` starts it before the server runs its lifespan).

        Raises:
            ModelLoadError: the model did not load (here, or in the scheduler process).
            RpcTimeout, SchedulerGone: the scheduler did not come up (or did not
                answer ``model_info``).
            EndpointInUse: the rpc endpoint is served by a live listener.
            RuntimeError: ``model_info`` failed. Whatever raises, what was
                started is closed first.
        """
        if self.engine is not None:
            return
        s = self.settings
        engine = self._make_engine(s)
        await engine.start()
        self.engine = engine
        try:
            if s.rpc_endpoint is not None:
                self.door = RpcDoor(s.rpc_endpoint, engine.endpoints.rpc,
                                    options=s.rpc_options, curve_clients=s.curve_clients,
                                    gone=lambda: engine.gone)
            self.max_model_len = await _max_model_len(engine)
        except BaseException:  # a start that fails stops what it started
            await self.close()
            raise
        translator = SamplingTranslator(self.tokenizer, model_name=s.model_name,
                                        max_model_len=self.max_model_len,
                                        guided=isinstance(s.model, HFModelSpec))
        self._gen = OpenAIServing(engine, translator, self.template, self.metrics,
                                  default_max_tokens=s.default_max_tokens)
        self._turns = self._gen.turns
        if self.metrics is not None:
            self._lag = asyncio.get_running_loop().create_task(self.metrics.probe_loop_lag())
        # What start-up built (torch, the tokenizer, the engine) leaves the garbage
        # collector's view: a full collection over it is ~100 ms of a stalled loop.
        gc.freeze()

    async def close(self) -> None:
        """Stop the door, then finish and close the engine. Idempotent."""
        if self._lag is not None:
            self._lag.cancel()
        if self.door is not None:
            self.door.close()
        if self.engine is not None:  # bounded: a hung scheduler held the exit 70 s
            await self.engine.close(timeout=ENGINE_CLOSE_S)
        if self.settings.run_dir is not None:  # (uvicorn re-raises SIGTERM: no atexit)
            shutil.rmtree(self.settings.run_dir, ignore_errors=True)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            try:
                event = await receive()
            except asyncio.CancelledError:  # a forced exit (a second Ctrl-C): no
                return  # shutdown event comes; the engine's own exit hooks clean up
            if event["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    log.exception("the engine did not start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- requests -----------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        assert isinstance(method, str) and isinstance(path, str)
        route = self._routes.get((method, path))
        extensions = scope.get("extensions")
        if not isinstance(extensions, dict):
            extensions = {}
        reply = Reply(send, request_id(scope), head=method == "HEAD",
                      whole=extensions.get(WHOLE), piece=extensions.get(PIECE))
        endpoint = route[0] if route is not None else "other"
        metrics = self.metrics
        if metrics is not None:
            metrics.in_flight += 1
        status = 500
        try:
            if route is None:
                allow = self._allowed.get(path)
                if allow is None:
                    raise self._not_found(method, path)
                raise ApiError(405, f"{method} is not allowed on {path} (allowed: {allow})",
                               code="bad_method", allow=allow)
            if method == "POST":
                # A request's work takes its turn before any of it runs: 256
                # requests arriving at once held the loop 20-30 ms between
                # their bodies and their tokenizing (frontend.turns).
                await (self._turns or loop_turns()).take()
            status = await route[1](scope, receive, reply, t0)
        except ApiError as exc:
            status = exc.status
            await send_failure(reply, exc)
        except asyncio.CancelledError:
            # Only the server's shutdown cancels here (a generation's own cancellation
            # is _guarded's): an answer in OpenAI's shape, not uvicorn's 500 and a
            # traceback per waiting /metrics call.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            status = 503
            with contextlib.suppress(Exception):  # (bounded: a client not reading)
                async with asyncio.timeout(CUT_SHORT_S):
                    await send_failure(reply, ApiError(503, "the server is shutting down",
                                                      type="server_error", code="shutting_down"))
        except Disconnected:
            status = 499  # nginx's "client closed request": nothing was sent
        except EngineError as exc:  # raised outside a generation's own conversion
            error = from_engine(exc)
            status = error.status
            await send_failure(reply, error)
        except Exception:  # a bug: logged, and a 500 in OpenAI's shape, not uvicorn's text
            log.exception("%s %s failed", method, path)
            status = 500
            with contextlib.suppress(Exception):  # (a client gone, a whole answer begun)
                await send_failure(reply, ApiError(500, "internal error (see the server's "
                                                   "log)", type="server_error", code="internal"))
        finally:
            if metrics is not None:
                metrics.in_flight -= 1
                metrics.answered(endpoint, status)

    def _not_found(self, method: str, path: str) -> ApiError:
        """The 404 for a path with no route (OpenAI's ``model_not_found`` for a model's)."""
        if path.startswith("/v1/models/"):
            return _no_model(path[len("/v1/models/"):], self.settings)
        return ApiError(404, self._off.get(path, f"no route {method} {clip(path)}"),
                        code="not_found")

    async def _guarded(self, receive: Receive, reply: Reply,
                       run: Callable[[Reply], Awaitable[int]], *, stream: bool = True) -> int:
        """Run ``run`` (given ``reply``) while watching the connection: a client that
        leaves cancels it (its request is aborted) and the answer is 499. A whole
        answer (``stream`` False) is watched from :data:`~frontend.asgi.WATCH_AFTER_S`
        on (:class:`~frontend.asgi.Conn`)."""
        conn = Conn(receive, reply, 0.0 if stream else WATCH_AFTER_S)
        try:
            return await run(reply)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if conn.gone:
                return 499
            # Cancelled from outside: the server is shutting down (uvicorn
            # cancels what is still answering after its grace period). A
            # stream ends with an error event, not cut mid-answer.
            error = ApiError(503, "the server is shutting down", type="server_error",
                             code="shutting_down")
            try:  # bounded: a client that is not reading must not hold the shutdown
                async with asyncio.timeout(CUT_SHORT_S):
                    begun = await reply.fail(error)
            except (TimeoutError, asyncio.CancelledError):  # (cancelled again: teardown)
                if task is not None and task.cancelling():
                    task.uncancel()
                return 503
            if begun:
                return 503
            raise error from None
        except SchedulerGone:
            self._gone = True
            raise
        finally:
            conn.close()

    def _body(self, scope: Scope, receive: Receive) -> Awaitable[bytes]:
        s = self.settings
        return read_body(scope, receive, s.max_body_bytes, s.body_timeout)

    def _generator(self, model: str) -> OpenAIServing:
        """The request path, for a request naming ``model``.

        Raises:
            ApiError: 404: ``model`` is not served here; 503: the scheduler is not
                available.
        """
        s = self.settings
        if model != s.model_name and model not in s.model_aliases:
            raise _no_model(model, s)
        if self._gen is None or self._gone:
            raise ApiError(503, "the scheduler is not available", type="server_error",
                           code="scheduler_unavailable")
        return self._gen

    async def _completions(self, scope: Scope, receive: Receive, send: Reply, t0: float) -> int:
        body = await self._body(scope, receive)
        req = decode(body, CompletionRequest)
        gen = self._generator(req.model)
        return await self._guarded(receive, send, lambda out: gen.completion(req, out, t0),
                                   stream=req.stream)

    async def _chat(self, scope: Scope, receive: Receive, send: Reply, t0: float) -> int:
        body = await self._body(scope, receive)
        req = decode(body, ChatCompletionRequest)
        gen = self._generator(req.model)
        return await self._guarded(receive, send, lambda out: gen.chat(req, out, t0),
                                   stream=req.stream)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Reply, t0: float) -> int:
        body = await self._body(scope, receive)
        req = decode(body, EmbeddingRequest)
        gen = self._generator(req.model)
        texts = await self._embedding_inputs(gen, req)
        engine = gen.engine

        async def run(send: Send) -> int:
            try:
                vectors = await asyncio.gather(*(engine.embed(ids) for ids in texts))
            except EngineError as exc:
                raise from_engine(exc) from None
            width = len(vectors[0]) if vectors else 0
            if req.dimensions is not None and req.dimensions != width:
                raise bad_request(f"dimensions: this model's embeddings have {width} "
                                  "dimensions", param="dimensions", code="unsupported_value")
            data = [EmbeddingData(i, base64.b64encode(np.ascontiguousarray(
                v, "<f4").tobytes()).decode() if req.encoding_format == "base64"
                else v.tolist()) for i, v in enumerate(vectors)]
            n = sum(len(t) for t in texts)
            await send_bytes(send, 200, encode(EmbeddingResponse(
                data, self.settings.model_name, EmbeddingUsage(n, n))))
            return 200

        return await self._guarded(receive, send, run, stream=False)

    async def _embedding_inputs(self, gen: OpenAIServing, req: EmbeddingRequest) -> list[list[int]]:
        limit = self.max_model_len

        def refuse(i: int, fewest: int) -> None:  # a text sure to pass it, untokenized
            if limit is not None and fewest > limit:
                raise bad_request(f"input[{i}]: this model's maximum context length is "
                                  f"{limit} tokens; this input is at least {fewest}",
                                  param="input", code="context_length_exceeded")

        texts = await gen.prompt_ids(req.input, "input", refuse=refuse)
        for i, ids in enumerate(texts):
            if limit is not None and len(ids) > limit:  # as a completion's prompt is told
                raise bad_request(f"input[{i}]: this model's maximum context length is "
                                  f"{limit} tokens; this input is {len(ids)}", param="input",
                                  code="context_length_exceeded")
        return texts

    def _card(self, name: str) -> ModelCard:
        return ModelCard(name, self._started, max_model_len=self.max_model_len)

    async def _models(self, scope: Scope, receive: Receive, send: Send, t0: float) -> int:
        s = self.settings
        await send_bytes(send, 200, encode(ModelList(
            [self._card(name) for name in (s.model_name, *s.model_aliases)])))
        return 200

    async def _model(self, scope: Scope, receive: Receive, send: Send, t0: float) -> int:
        """``GET /v1/models/{name}`` (the openai client's ``models.retrieve``); another
        name has no route: 404."""
        path = scope["path"]
        assert isinstance(path, str)
        await send_bytes(send, 200, encode(self._card(path[len("/v1/models/"):])))
        return 200

    async def _health(self, scope: Scope, receive: Receive, send: Send, t0: float) -> int:
        engine = self.engine
        if engine is None or self._gen is None or self._gone or engine.closed:
            raise ApiError(503, "the scheduler is not running", type="server_error",
                           code="scheduler_unavailable")
        try:
            reply = await _within_rpc_wait(engine.collective_rpc("get_load",
                                                                 timeout=RPC_WAIT_S))
        except Exception as exc:
            if isinstance(exc, SchedulerGone):
                self._gone = True
            raise ApiError(503, f"the scheduler does not answer: {exc}", type="server_error",
                           code="scheduler_unavailable") from None
        if not reply.success:
            raise ApiError(503, f"the scheduler answered get_load with a failure: "
                                f"{reply.message}", type="server_error",
                           code="scheduler_unavailable")
        await send_bytes(send, 200, b'{"status":"ok"}', JSON)
        return 200

    async def _metrics(self, scope: Scope, receive: Receive, send: Send, t0: float) -> int:
        engine = self.engine
        if self.metrics is None or engine is None or self._gen is None:  # (no route when off)
            raise ApiError(503, "the engine is not running", type="server_error",
                           code="scheduler_unavailable")
        try:
            text = (await _within_rpc_wait(engine.metrics(timeout=RPC_WAIT_S))).encode()
        except (BusError, TimeoutError) as exc:  # (RpcTimeout too: busy past 5 s)
            raise ApiError(503, f"the scheduler's metrics are not available: {exc}",
                           type="server_error", code="scheduler_unavailable") from None
        await send_bytes(send, 200, text + self.metrics.text(), TEXT)
        return 200


def _no_model(name: str, s: Settings) -> ApiError:
    """The 404 for model ``name``, not one ``s`` serves (a request's, a path's)."""
    served = ", ".join(map(repr, (s.model_name, *s.model_aliases)))
    return ApiError(404, f"the model {clip(name)!r} does not exist here: this server serves "
                         f"{served} (GET /v1/models)", param="model", code="model_not_found")


async def _within_rpc_wait(call: Awaitable[T]) -> T:
    """``call``'s answer, or ``TimeoutError`` once it took ``RPC_WAIT_S``: each ``/health``
    and ``/metrics`` call waits for its own rpc (many are in flight at once), never
    longer than that, however the scheduler fares."""
    try:
        async with asyncio.timeout(RPC_WAIT_S):
            return await call
    except TimeoutError:
        raise TimeoutError(f"no answer within {RPC_WAIT_S:g} s") from None
