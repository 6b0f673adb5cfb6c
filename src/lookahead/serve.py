"""`lookahead serve`: an OpenAI-compatible HTTP server on the engine (FastAPI).

One background thread steps the engine; each HTTP request adds an engine request and reads the tokens
the engine commits for it from an asyncio queue. Streaming replies are server-sent events ending with
`data: [DONE]`; a client that goes away aborts its request, which frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .config import AUTO_CONFIG, PLAIN_CONFIG, LookaheadConfig
from .core.suffix import Corpus
from .engine import Engine, RequestParams, StepOutput
from .prompts import encode_messages, has_chat_template

# The page at `/`: a chat box streaming from /v1/chat/completions, with tokens/s and tokens/step live.
CHAT_PAGE = (resources.files(__package__) / "web" / "chat.html").read_text(encoding="utf-8")


class Message(BaseModel):
    role: str
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Our extension: "auto" (the default), "off", or {"window": W, "ngram": N, "guesses": G}.
    lookahead: str | dict[str, int] = "auto"


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Common):
    prompt: str


class Metrics:
    """What `GET /metrics` reports, in Prometheus' text format (a registry per app)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lookahead_requests", "Completion requests accepted", ["endpoint"],
                                registry=self.registry)
        self.prompt_tokens = Counter("lookahead_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=self.registry)
        self.tokens = Counter("lookahead_generated_tokens", "Tokens generated", registry=self.registry)
        self.tokens_per_step = Histogram("lookahead_tokens_per_step", "A finished request's tokens per step",
                                         buckets=(1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0),
                                         registry=self.registry)
        self.first_token = Histogram("lookahead_time_to_first_token_seconds", "From a request's arrival to its "
                                     "first token", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
                                     registry=self.registry)
        self.inter_token = Histogram("lookahead_inter_token_latency_seconds", "Time between a request's tokens",
                                     buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
                                     registry=self.registry)
        Gauge("lookahead_queue_depth", "Requests waiting for a slot", registry=self.registry).set_function(
            lambda: loop.engine.waiting())
        Gauge("lookahead_running", "Requests decoding", registry=self.registry).set_function(
            lambda: loop.engine.running())


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


@dataclass
class _Stream:
    """What one HTTP request reads: the engine's outputs for its request, in order."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class EngineLoop:
    """Steps the engine on a thread of its own; `add` and `abort` may be called from any thread."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="lookahead-engine", daemon=True)
        self._thread.start()

    def add(self, prompt: torch.Tensor, params: RequestParams) -> tuple[int, _Stream]:
        with self._lock:
            if self.engine.running() + self.engine.waiting() >= self.engine.max_batch + self.max_queue:
                raise APIError(429, f"the server is full ({self.engine.max_batch} requests decode, {self.max_queue} "
                                    "may wait); retry later",
                               kind="rate_limit_error")
            try:
                request = self.engine.add_request(prompt, params)
            except ValueError as error:
                raise APIError(400, str(error)) from error
            stream = self._streams[request] = _Stream(asyncio.get_running_loop())
        self._wake.set()
        return request, stream

    def abort(self, request: int) -> None:
        with self._lock:
            self.engine.abort(request)
            self._streams.pop(request, None)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished()
                try:
                    outputs = self.engine.step() if busy else []
                except Exception:  # noqa: BLE001 - a failed step ends its requests instead of hanging them
                    traceback.print_exc()
                    outputs = [StepOutput(request, [], True) for request in self._streams]
                    for request in outputs:
                        self.engine.abort(request.request_id)
                deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._streams.pop(output.request_id, None)
            for stream, output in deliveries:
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()


def _lookahead_config(value: str | dict[str, int]) -> LookaheadConfig:
    if value == "auto":
        return AUTO_CONFIG
    if value == "off":
        return PLAIN_CONFIG
    if isinstance(value, dict):
        unknown = set(value) - {"window", "ngram", "guesses"}
        if unknown:
            raise APIError(400, f"lookahead takes window, ngram and guesses; got {sorted(unknown)}", "lookahead")
        try:
            return LookaheadConfig(**value)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), "lookahead") from error
    raise APIError(400, f"lookahead must be 'auto', 'off' or {{window, ngram, guesses}}, got {value!r}", "lookahead")


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_name: str = "lookahead",
               max_batch: int = 8, max_queue: int = 64, max_length: int | None = None,
               api_keys: tuple[str, ...] = (), corpus_megabytes: int = 64, compile: bool | str = False) -> FastAPI:
    """The app: OpenAI's chat and text completions, models, health. Requests decode on one engine of
    `max_batch` slots; beyond `max_queue` waiting requests, new ones get 429. With `api_keys`, every
    request must carry one (`Authorization: Bearer KEY`); each key has a corpus of its own (the suffix
    and recycle sources draft from earlier requests of the same key, never of another one). compile: as in `generate`;
    the step shapes compile before the app is returned (`Engine.warm_up`: minutes on a small CPU)."""
    engine = Engine(model, max_batch=max_batch, max_length=max_length, compile=compile)
    engine.warm_up()  # compiled steps: their shapes compile now, not during the first requests
    runner = EngineLoop(engine, max_queue)
    corpora: dict[str | None, Corpus] = {}
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        runner.stop()

    app = FastAPI(title="lookahead", lifespan=lifespan)
    metrics = Metrics(runner)
    app.state.engine_loop = runner
    app.state.corpora = corpora

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return _error(error.status, error.message, error.param, error.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return _error(400, f"{where}: {first['msg']}" if where else first["msg"], where or None, "invalid_request_error")

    def authorise(request: Request) -> str | None:
        if not api_keys:
            return None
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if given not in api_keys:
            raise APIError(401, "invalid API key: pass one of the server's --api-key values as a Bearer token",
                           kind="authentication_error")
        return given

    def params_of(body: _Common, key: str | None, max_tokens: int | None) -> RequestParams:
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                           "not_found_error")
        if body.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
        corpus = corpora.setdefault(key, Corpus(max_megabytes=corpus_megabytes))
        return RequestParams(max_new_tokens=max_tokens or 256, config=_lookahead_config(body.lookahead),
                             do_sample=body.temperature > 0, temperature=body.temperature or None,
                             top_p=body.top_p, top_k=0, seed=body.seed if body.temperature > 0 else None,
                             corpus=corpus)

    async def run(request: Request, body: _Common, prompt: torch.Tensor, params: RequestParams, chat: bool):
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        started = time.time()
        arrived = time.perf_counter()
        rid, stream = runner.add(prompt, params)
        metrics.requests.labels("chat" if chat else "completions").inc()
        metrics.prompt_tokens.inc(prompt.numel())
        reply = _Reply(tokenizer, stops)
        steps = 0  # decoding steps that gave this request tokens
        name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        usage = lambda: {"prompt_tokens": prompt.numel(), "completion_tokens": reply.tokens,  # noqa: E731
                         "total_tokens": prompt.numel() + reply.tokens}

        async def outputs() -> AsyncIterator[str]:
            """The reply's text pieces; ends when the request finishes or a stop string is met."""
            nonlocal steps
            last = None
            try:
                while True:
                    output: StepOutput = await stream.queue.get()
                    now = time.perf_counter()
                    if output.tokens:
                        # Tokens of one step arrive together: they share its interval (the first step's
                        # later tokens came with the first one, at no interval).
                        gaps = [0.0] * (len(output.tokens) - 1) if last is None else \
                            [(now - last) / len(output.tokens)] * len(output.tokens)
                        if last is None:
                            metrics.first_token.observe(now - arrived)
                        for gap in gaps:
                            metrics.inter_token.observe(gap)
                        last = now
                        steps += 1
                        metrics.tokens.inc(len(output.tokens))
                    if output.stats is not None and output.stats.steps:
                        metrics.tokens_per_step.observe(output.stats.tokens_per_step)
                    piece = reply.add(output.tokens, output.finished)
                    if piece:
                        yield piece
                    if reply.stopped or output.finished:
                        reply.finish_reason = "stop" if reply.stopped or not reply.hit_length(params) else "length"
                        return
            finally:  # a stop string, or a client gone: the engine drops it (a finished request is gone already)
                runner.abort(rid)

        def chunk(piece: str | None, finish: str | None) -> dict:
            choice = ({"index": 0, "delta": ({"content": piece} if piece is not None else {}), "finish_reason": finish}
                      if chat else {"index": 0, "text": piece or "", "finish_reason": finish})
            return {"id": name, "object": f"{kind}.chunk" if chat else kind, "created": int(started),
                    "model": model_name, "choices": [choice]}

        if body.stream:
            async def events() -> AsyncIterator[str]:
                if chat:
                    first = chunk(None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield f"data: {json.dumps(first)}\n\n"
                async for piece in outputs():
                    if await request.is_disconnected():
                        return
                    event = chunk(piece, None)
                    event["lookahead"] = {"tokens": reply.tokens, "steps": steps}  # our extension; clients ignore it
                    yield f"data: {json.dumps(event)}\n\n"
                yield f"data: {json.dumps(chunk(None, reply.finish_reason))}\n\n"
                if body.stream_options is not None and body.stream_options.include_usage:
                    last = chunk(None, None)
                    last["choices"], last["usage"] = [], usage()
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join([piece async for piece in outputs()])
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reply.finish_reason}
                  if chat else {"index": 0, "text": text, "finish_reason": reply.finish_reason})
        return {"id": name, "object": kind, "created": int(started), "model": model_name, "choices": [choice],
                "usage": usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        key = authorise(request)
        params = params_of(body, key, body.max_completion_tokens or body.max_tokens)
        messages = [m.model_dump() for m in body.messages]
        if has_chat_template(tokenizer):
            prompt = encode_messages(tokenizer, messages)[0]
        else:
            prompt = tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"][0]
        return await run(request, body, prompt, params, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        key = authorise(request)
        params = params_of(body, key, body.max_tokens)
        if not body.prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        prompt = tokenizer(body.prompt, return_tensors="pt")["input_ids"][0]
        return await run(request, body, prompt, params, chat=False)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return CHAT_PAGE

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "lookahead"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.running(), "waiting": engine.waiting()}

    return app


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """Serves `app` with uvicorn on a port of `host` the system picks, on a thread of this process: yields
    its URL, and stops the server on leaving (for tests and `lookahead bench serve`)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="lookahead-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class _Reply:
    """A reply's text as tokens arrive: decoded whole each time, released up to the last complete
    character, cut at the first stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self.finish_reason: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def hit_length(self, params: RequestParams) -> bool:
        return self.tokens >= params.max_new_tokens

    def add(self, tokens: list[int], finished: bool = False) -> str:
        """The text to send after these tokens. Until the request has finished, a character cut in the middle
        and a tail that may be the start of a stop string wait for the next tokens: text once sent cannot be
        taken back when a stop string completes across two steps."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped = text[:at], True
        if not (self.stopped or finished):
            if text.endswith("\ufffd"):
                return ""
            started = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
            text = text[:len(text) - started]
        piece, self.sent = text[len(self.sent):], text
        return piece
