"""`lookahead serve`: an OpenAI-compatible HTTP server on the engine (FastAPI).

One background thread steps the engine; each HTTP request adds an engine request and reads the tokens
the engine commits for it from an asyncio queue. Streaming replies are server-sent events ending with
`data: [DONE]`, or with an error event when the engine fails; a client that goes away, streaming or not,
aborts its request, which frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import ipaddress
import json
import re
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

import jinja2
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria

from .config import AUTO_CONFIG, PLAIN_CONFIG, LookaheadConfig
from .core.suffix import Corpus
from .engine import Engine, RequestParams, StepOutput, eos_ids
from .hf import vocabulary_size
from .prompts import encode_messages, has_chat_template

# The page at `/`: a chat box streaming from /v1/chat/completions, with tokens/s and tokens/step live.
CHAT_PAGE = (resources.files(__package__) / "web" / "chat.html").read_text(encoding="utf-8")


def _inline_hash(page: str, tag: str) -> str:
    """A page's inline <tag> element as a Content-Security-Policy source: the hash of its text."""
    text = page[page.index(f"<{tag}>") + len(tag) + 2:page.index(f"</{tag}>")]
    return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"


# The page runs its own script and style and calls this server alone; no other site may frame it (a click
# on a hidden frame of it would send what another page chose).
PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; connect-src 'self'; script-src {_inline_hash(CHAT_PAGE, 'script')}; "
                               f"style-src {_inline_hash(CHAT_PAGE, 'style')}; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
# A text completion's reply is this long at most when the client sets no max_tokens, as in OpenAI's API (a chat
# reply, as there, may take what is left of the context).
DEFAULT_COMPLETION_TOKENS = 16
# A temperature below this decodes greedily, as vLLM has it: dividing logits by a far smaller one overflows them
# to infinities, and the tokens drawn from those are noise.
GREEDY_BELOW = 1e-5
# How long a client turned away for a full server should wait before retrying (`Retry-After`).
RETRY_AFTER_SECONDS = 1
# How often a non-streaming request checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.25
INT64 = (-(2**63), 2**63 - 1)  # a seed's range
# A request body's size at most: a full context of token ids for each prompt the server can hold is far less.
MAX_BODY_BYTES = 16 * 2**20
TEXT_SLACK = 4  # see `answer`: a prompt's characters past this times max_length times the longest piece's are refused
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Stop strings a request may give, and their length: each is searched for at every step (OpenAI takes 4).
MAX_STOPS, MAX_STOP_CHARACTERS = 16, 1000
T = TypeVar("T")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        """OpenAI's error schema."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def check_corpus_megabytes(megabytes: float, name: str) -> None:
    """Raise ValueError, naming the option `name`, for a cap of each key's corpus that no corpus can take (0: none)."""
    if megabytes != 0:
        try:
            Corpus(max_megabytes=megabytes)
        except ValueError as error:
            raise ValueError(f"{name} must be 0 (no corpus) or a corpus's cap: {error}") from None


def _server_full(max_batch: int, max_queue: int) -> APIError:
    return APIError(429, f"the server is full ({max_batch} requests decode, {max_queue} may wait); retry later",
                    kind="rate_limit_error", code="rate_limit_exceeded")


class _Body(BaseModel):
    """An object of a request body. An explicit null means the field's default, as in OpenAI's API (its
    client sends null for options left unset). Strict: a value of the wrong JSON type is refused, not
    converted ("yes" is no boolean, true no number, 2.0 no count)."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {name: value for name, value in data.items() if value is not None} if isinstance(data, dict) else data


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's; "developer" is its
    # newer name for "system", which chat templates know
    content: Any = None  # checked by `_message_text`: a string or text parts, or null (an assistant's tool calls)
    # Handed to the chat template where set (templates that know them render them): a participant's name, an
    # assistant's tool calls and the id of the call a tool message answers.
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # What an assistant message of OpenAI's replies carries besides, sent back with the conversation: accepted,
    # not rendered. Any other field is refused, as at the top level (a misspelt one would be ignored).
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    model_config = ConfigDict(strict=True, extra="forbid")


class _Common(_Body):
    # Unknown fields are kept for `refuse_unsupported`, which refuses every one but OpenAI's informational fields,
    # as OpenAI does: a misspelt `max_token` had been ignored, leaving the reply without a cap.
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=0, strict=True)  # 0: only with a text completion's echo
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0: the likeliest token alone, as OpenAI takes it
    top_k: int = Field(0, ge=-1, strict=True)  # vLLM's extension: -1 or 0 keep every token
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1], strict=True)
    stop: str | list[str] | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Our extension: "auto" (the default), "off", or {"window": W, "ngram": N, "guesses": G}.
    lookahead: str | dict[str, int] = "auto"

    # What a field of several types may be, for the message when a value is none of them.
    UNIONS: ClassVar[dict[str, str]] = {
        "stop": "a string or a list of strings",
        "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
        "lookahead": '"auto", "off" or an object of integers {"window": W, "ngram": N, "guesses": G}'}

    # New tokens at most without a cap from the client (None: what is left of the context).
    DEFAULT_TOKENS: ClassVar[int | None] = None
    KIND: ClassVar[str] = "chat completions"

    # OpenAI's fields that this server does not implement, each with the values that ask for nothing more
    # than what it does (the first one is the one to suggest).
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "repetition_penalty": (1,), "min_p": (0,), "ignore_eos": (False,), "min_tokens": (0,), "stop_token_ids": ([],),
        "modalities": (["text"],), "audio": (), "web_search_options": ()}  # vLLM's extensions, OpenAI's audio and search
    # OpenAI's fields that change nothing in a reply (who asked, what to store, a latency hint): accepted, ignored.
    INFORMATIONAL: ClassVar[frozenset[str]] = frozenset({
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
        "parallel_tool_calls", "prediction"})

    def refuse_unsupported(self) -> None:
        """400 for the first field set to a value that asks for more than this server does, or that it does not
        know."""
        for name, value in (self.model_extra or {}).items():
            if name in self.UNSUPPORTED:
                harmless = self.UNSUPPORTED[name]
                if value is not None and value not in harmless:
                    allowed = f" or set it to {json.dumps(harmless[0])}" if harmless else ""
                    raise APIError(400, f"{name} is not supported by this server: leave it out{allowed}", name)
            elif name not in self.INFORMATIONAL:
                raise APIError(400, f"unrecognized request field {name!r} (this server takes OpenAI's "
                                    f"{self.KIND} fields, vLLM's top_k and its own lookahead)", name)

    def stop_strings(self) -> list[str]:
        """The stop strings given; 400 for more than MAX_STOPS of them or one past MAX_STOP_CHARACTERS."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop holds {len(stops)} strings; this server takes at most {MAX_STOPS}", "stop")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_CHARACTERS:
            raise APIError(400, f"a stop string may be at most {MAX_STOP_CHARACTERS} characters long, got one of "
                                f"{len(longest)}", "stop")
        return stops

    def token_limit(self) -> tuple[str, int | None]:
        """The client's cap on new tokens (None: none given) and the field it came in."""
        return "max_tokens", self.max_tokens

    def echoes(self) -> bool:
        """Whether the reply's text starts with the prompt's."""
        return False

    def logprobs_asked(self) -> int | None:
        """None: no log-probabilities; k: each token's, with the k likeliest tokens at its position."""
        raise NotImplementedError

    def prompt_count(self) -> int:
        """How many prompts the request holds (a choice for each), known before any is tokenized."""
        return 1


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Common.UNSUPPORTED, "echo": (False,), "tools": ([],),
        "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
        "response_format": ({"type": "text"},)}
    PROMPT_FIELD: ClassVar[str] = "messages"

    def token_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().token_limit()

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def text_size(self) -> int:
        """Characters of text in the prompt (the messages' contents), before anything tokenizes it."""
        return sum(len(_message_text(m, i)) for i, m in enumerate(self.messages))

    def prompts(self, tokenizer: PreTrainedTokenizerBase, vocabulary: int) -> list[tuple[torch.Tensor, str]]:
        """The conversation through the chat template; no text (a chat reply does not echo). 400 where the
        tokenizer has none, as vLLM answers: its texts joined by lines, as they had been, lost who said what."""
        if not has_chat_template(tokenizer):
            raise APIError(400, "the model's tokenizer has no chat template to lay out messages with: send the text "
                                "to /v1/completions as a prompt", "messages")
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": _message_text(m, i),
                  **m.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)}
                 for i, m in enumerate(self.messages)]
        try:
            return [(encode_messages(tokenizer, turns)[0], "")]
        except jinja2.TemplateError as error:  # a template's raise_exception, e.g. "roles must alternate"
            raise APIError(400, f"the model's chat template refuses these messages: {error}", "messages") from error


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # several: a choice for each, in their order
    logprobs: int | None = Field(None, ge=0, le=5, strict=True)
    echo: bool = False  # the reply's text starts with the prompt's (and its logprobs with the prompt tokens')

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_Common.UNSUPPORTED, "suffix": ("",), "best_of": (1,)}
    PROMPT_FIELD: ClassVar[str] = "prompt"
    KIND: ClassVar[str] = "text completions"
    DEFAULT_TOKENS: ClassVar[int | None] = DEFAULT_COMPLETION_TOKENS

    def echoes(self) -> bool:
        return self.echo

    def refuse_unsupported(self) -> None:
        if (self.model_extra or {}).get("max_completion_tokens") is not None:  # else silently no cap at all
            raise APIError(400, "max_completion_tokens is a field of chat completions; text completions take "
                                "max_tokens", "max_completion_tokens")
        super().refuse_unsupported()

    def _given(self) -> list[str] | list[list[int]]:
        return [self.prompt] if isinstance(self.prompt, str) or (
            self.prompt and isinstance(self.prompt[0], int)) else self.prompt

    def prompt_count(self) -> int:
        return len(self._given())

    def text_size(self) -> int:
        """Characters of the longest prompt given as text, before anything tokenizes it."""
        return max((len(text) for text in self._given() if isinstance(text, str)), default=0)

    def prompts(self, tokenizer: PreTrainedTokenizerBase, vocabulary: int) -> list[tuple[torch.Tensor, str]]:
        """Each prompt's token ids and text (token ids given: their decoded text); 400 for none or for a token
        id outside the vocabulary."""
        given = self._given()
        if not given:
            raise APIError(400, "prompt must not be empty", "prompt")
        prompts = []
        for text in given:
            if isinstance(text, str):
                prompts.append((tokenizer(text, return_tensors="pt")["input_ids"][0], text))
                continue
            outside = [t for t in text if not 0 <= t < vocabulary]
            if outside:
                raise APIError(400, f"prompt token ids must be in [0, {vocabulary}), got {outside[0]}", "prompt")
            prompts.append((torch.tensor(text, dtype=torch.long), tokenizer.decode(text)))
        return prompts

    def logprobs_asked(self) -> int | None:
        return self.logprobs


RequestBody = ChatRequest | CompletionRequest


def _message_text(message: Message, index: int) -> str:
    """A message's content as one string: its text parts joined by lines; an assistant's null content (a
    turn of tool calls) is empty."""
    where = f"messages[{index}].content"
    content = message.content
    if isinstance(content, str):
        return content
    if content is None and message.role == "assistant":
        return ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts (null only in an assistant's "
                            f"message), got {json.dumps(content)}", where)
    texts = []
    for number, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{number}] is a part of type {kind!r}; this server takes only text parts "
                                '({"type": "text", "text": "..."})', f"{where}[{number}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _field_path(location: tuple[int | str, ...]) -> str:
    """A field as OpenAI writes it: messages[0].content."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".")


async def _json_body(request: Request) -> Any:
    """The request's body parsed as JSON: 415 unless it is sent as JSON (a browser posts other types to any
    site without asking it first), 413 past MAX_BODY_BYTES, 400 for what is not JSON text."""
    kind = request.headers.get("content-type", "")
    media = kind.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the request body must be sent as JSON (Content-Type: application/json), got "
                            f"{kind or 'no Content-Type'}")
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"the request body exceeds this server's limit of {MAX_BODY_BYTES} bytes")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except ValueError as error:  # bad JSON or bad UTF-8
        raise APIError(400, f"the request body is not valid JSON: {error}") from error
    except RecursionError as error:
        raise APIError(400, "the request body is not valid JSON: it nests too deeply") from error
    if _SURROGATE_ESCAPE.search(raw):  # JSON may escape half a character (\ud800) that no text holds alone
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError as error:
            raise APIError(400, "the request body is not valid JSON text: it holds an unpaired surrogate "
                                f"({error.object[error.start:error.end]!a}), half of a character") from error
    return data


async def _parse(request: Request, schema: type[RequestBody]) -> RequestBody:
    """The request's JSON body as `schema`; 400 naming the first field at fault."""
    data = await _json_body(request)
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = first["loc"][0] if first["loc"] else None
        if field in schema.UNIONS:  # pydantic names each type it tried (stop.str): say what the field may be
            raise APIError(400, f"{field} must be {schema.UNIONS[field]}", field) from error
        where = _field_path(first["loc"])
        raise APIError(400, f"{where or 'the request body'}: {first['msg']}", where or None) from error


async def _joined(pieces: AsyncIterator[str]) -> str:
    return "".join([piece async for piece in pieces])


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None once the client has gone; `work` is then cancelled (which aborts its engine
    request: a non-streaming reply that nobody will read must not keep its slot until max_tokens)."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS))[0]:
            if await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()


class Metrics:
    """What `GET /metrics` reports, in Prometheus' text format (a registry per app)."""

    def __init__(self, loop: EngineLoop, tokenizing: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lookahead_requests", "Completion requests accepted", ["endpoint"],
                                registry=self.registry)
        self.prompt_tokens = Counter("lookahead_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=self.registry)
        self.tokens = Counter("lookahead_generated_tokens", "Tokens generated", registry=self.registry)
        self.errors = Counter("lookahead_error_responses", "Requests answered with an error status", ["status"],
                              registry=self.registry)
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
        Gauge("lookahead_tokenizing", "Requests waiting for the tokenizer or in it", registry=self.registry
              ).set_function(tokenizing)


@dataclass(frozen=True)
class _TokenLogprobs:
    """Tokens' log-probabilities (the log-softmax of their float32 logits) and the `top` likeliest tokens at each
    position, as (id, log-probability) pairs."""

    chosen: list[float]
    likeliest: list[list[tuple[int, float]]]

    @staticmethod
    def of(tokens: list[int], logits: torch.Tensor, top: int) -> _TokenLogprobs:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
        if not top:
            return _TokenLogprobs(chosen, [[] for _ in tokens])
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # (a vocabulary smaller than top)
        return _TokenLogprobs(chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())])


@dataclass
class _Stream:
    """What one HTTP request reads: the engine's outputs for its request, in order, each with its tokens'
    log-probabilities where `top` (the likeliest tokens asked for at each position) is set, or the error that ended
    it. The log-probabilities are cut from the logits on the engine's thread: a reader that falls behind (a stalled
    client) then holds a few numbers a token, not a row of the vocabulary (it had held hundreds of MB a stream)."""

    loop: asyncio.AbstractEventLoop
    top: int | None = None
    queue: asyncio.Queue[tuple[StepOutput, _TokenLogprobs | None] | APIError] = field(default_factory=asyncio.Queue)

    def put(self, delivery: StepOutput | APIError) -> None:
        """Hand `delivery` to the reader's loop (from the engine's thread). Scoring that fails (out of memory, say)
        fails this request alone (its reader aborts it), not the engine's thread."""
        if isinstance(delivery, StepOutput):
            try:
                scored = None
                if self.top is not None and delivery.logits is not None and delivery.tokens:
                    scored = _TokenLogprobs.of(delivery.tokens, delivery.logits, self.top)
                delivery = (dataclasses.replace(delivery, logits=None), scored)
            except Exception as error:  # noqa: BLE001 - logged; the request ends with a server error
                traceback.print_exc()
                delivery = _engine_failure(error)
        _call_on(self.loop, self.queue.put_nowait, delivery)


class EngineLoop:
    """Steps the engine on a thread of its own. `add` (from an event loop), `abort` and `finish` (from any
    thread) hand their work to that thread, which does it between steps: none waits for a step in progress
    (which would hold up every other stream, the health check and the disconnect polls of the event loop
    meanwhile), nor for several, as when they took a lock the busy engine took again right after each step."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._added: deque[tuple[torch.Tensor, RequestParams, _Stream, asyncio.Future]] = deque()
        self._ended: deque[tuple[int, int | None]] = deque()  # requests to end before the next step (`abort`, `finish`)
        self._stopped = False
        self._ending = threading.Lock()
        self._ended_all = False  # the thread has answered everything queued and takes nothing more
        self._thread = threading.Thread(target=self._run, name="lookahead-engine", daemon=True)
        self._thread.start()

    async def add(self, prompt: torch.Tensor, params: RequestParams, top: int | None = None) -> tuple[int, _Stream]:
        """Queue a request, before the engine's next step; its id and the stream of its outputs (with their
        log-probabilities and the `top` likeliest tokens where `top` is set: `params` asks for logits). Raises
        APIError 429 where the queue is full, 400 where the engine refuses the request, 503 where the engine
        has stopped."""
        loop = asyncio.get_running_loop()
        added = loop.create_future()
        with self._ending:  # not appended after the thread's last look at the queue
            if not self.alive() or self._ended_all:
                raise _engine_stopped()
            self._added.append((prompt, params, _Stream(loop, top), added))
        self._wake.set()
        return await added

    def _admit(self, prompt: torch.Tensor, params: RequestParams, stream: _Stream, added: asyncio.Future) -> None:
        """`add`'s work, on the engine's thread; its answer set on the caller's loop."""
        try:
            if self.engine.running() + self.engine.waiting() >= self.engine.max_batch + self.max_queue:
                raise _server_full(self.engine.max_batch, self.max_queue)
            try:
                request = self.engine.add_request(prompt, params)
            except ValueError as error:
                raise APIError(400, str(error)) from error
            except Exception as error:  # noqa: BLE001 - the engine's own failure: this request's, not the loop's
                traceback.print_exc()
                raise _engine_failure(error) from error
        except APIError as error:
            answer = functools.partial(_settle, added, error=error)
        else:
            self._streams[request] = stream
            answer = functools.partial(_settle, added, (request, stream), on_cancelled=lambda: self.abort(request))
        _call_on(stream.loop, answer)

    def abort(self, request: int) -> None:
        self._ended.append((request, None))
        self._wake.set()

    def finish(self, request: int, tokens: int) -> None:
        """End a request whose reply a stop string cut after `tokens` tokens (`Engine.finish`)."""
        self._ended.append((request, tokens))
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        """Whether the engine's thread still takes and decodes requests."""
        return not self._stopped and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # noqa: BLE001 - logged; the thread ends and what it held is answered below
            traceback.print_exc()
        finally:  # stopped, or died of an error outside a step: nobody would ever answer those still waiting
            with self._ending:
                self._ended_all = True
                while self._added:
                    _, _, stream, added = self._added.popleft()
                    _call_on(stream.loop, _settle, added, None, _engine_stopped())
            for stream in self._streams.values():
                stream.put(_engine_stopped())
            self._streams.clear()

    def _end(self, request: int, tokens: int | None) -> None:
        """`abort` or `finish`'s work. Its reply has been sent or dropped already: a failure here is only logged."""
        self._streams.pop(request, None)
        try:
            if tokens is None:
                self.engine.abort(request)
            else:
                self.engine.finish(request, tokens)
        except Exception:  # noqa: BLE001 - the request ends either way; the next step frees its slot or fails
            traceback.print_exc()

    def _serve(self) -> None:
        while not self._stopped:
            while self._ended:  # first: the slots of requests that ended are free for those arriving
                self._end(*self._ended.popleft())
            while self._added:
                self._admit(*self._added.popleft())
            busy = self.engine.has_unfinished()
            try:
                outputs = self.engine.step() if busy else []
            except Exception as error:  # noqa: BLE001 - a failed step fails its requests; the server goes on
                traceback.print_exc()
                # Those holding a slot were in the step, those still waiting not, unless none held one (the
                # step failed before admitting any): then nothing else would ever end the waiting ones.
                failed = self.engine.running_ids() or list(self._streams)
                deliveries = [(self._streams.pop(request, None), _engine_failure(error)) for request in failed]
                for request in failed:
                    self.engine.abort(request)
            else:
                deliveries = [(self._streams.get(o.request_id), o if o.error is None else _engine_failure(o.error))
                              for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._streams.pop(output.request_id, None)
            for stream, delivery in deliveries:
                if stream is not None:
                    stream.put(delivery)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()


def _call_on(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    """`callback(*args)` on `loop`, from the engine's thread; nothing where the loop is closed (nobody waits)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _settle(future: asyncio.Future, result: Any = None, error: Exception | None = None,
            on_cancelled: Callable[[], None] | None = None) -> None:
    """Answer `future` (on its loop); where its caller has gone meanwhile, `on_cancelled` instead."""
    if future.cancelled():
        if on_cancelled is not None:
            on_cancelled()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _engine_stopped() -> APIError:
    return APIError(503, "the server's engine has stopped; no request can be decoded", kind="server_error")


def _engine_failure(error: Exception) -> APIError:
    return APIError(500, f"the engine failed while decoding this request ({type(error).__name__}: {error}); it was "
                         "dropped, retry it", kind="server_error")


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


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_name: str = "lookahead",
               max_batch: int = 8, max_queue: int = 64, max_length: int | None = None,
               api_keys: tuple[str, ...] = (), corpus_megabytes: float = 64, compile: bool | str = False,
               allow_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The app: OpenAI's chat and text completions, models, health. Requests decode on one engine of
    `max_batch` slots; beyond `max_queue` waiting requests, new ones get 429. With `api_keys`, every
    request must carry one (`Authorization: Bearer KEY`); each key has a corpus of its own (the suffix
    and recycle sources draft from earlier requests of the same key, never of another one), of at most
    `corpus_megabytes` (0: none). allow_origins: the web origins whose pages may call the API from a browser
    (CORS; "*" for any), none by default. allowed_hosts: the names a request may be addressed to (its Host
    header; `hosts_to_allow` gives those of a server on this machine), any by default. compile: as in `generate`;
    the step shapes compile before the app is returned (`Engine.warm_up`: minutes on a small CPU)."""
    for key in api_keys:  # a blank key would let requests without one in; a padded one could never match
        if not isinstance(key, str) or not key or key != key.strip() or " " in key:
            raise ValueError(f"an API key must be a non-empty string without spaces, got {key!r}")
    for origin in allow_origins:  # browsers send an origin without a path: "http://host:3000/" would never match
        parts = urlsplit(origin) if isinstance(origin, str) else None
        if origin != "*" and not (parts and parts.scheme in ("http", "https") and parts.netloc
                                  and not (parts.path or parts.query or parts.fragment)):
            raise ValueError(f"an allowed origin must be * or scheme://host[:port], as a browser sends it (no path, "
                             f"no trailing slash), got {origin!r}")
    check_corpus_megabytes(corpus_megabytes, "corpus_megabytes")  # here, not at a request
    engine = Engine(model, max_batch=max_batch, max_length=max_length, compile=compile)
    engine.warm_up()  # compiled steps: their shapes compile now, not during the first requests
    engine_loop = EngineLoop(engine, max_queue)
    # As many requests in scoring as the engine holds: the prompts of one request never turn each other away.
    score_prompt = _PromptScorer(model, max_batch + max_queue - 1, functools.partial(_server_full, max_batch, max_queue))
    corpora: dict[str | None, Corpus] = {}
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookahead-tokenizer")
    tokenizer_backlog = 0  # requests waiting for `tokenizing` or in it
    piece_characters = max(map(len, tokenizer.get_vocab()), default=1)  # the longest text one token stands for

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine_loop.stop()
        tokenizing.shutdown(wait=False)

    app = FastAPI(title="lookahead", lifespan=lifespan)
    if allow_origins:  # browsers send a preflight first: it must pass without an API key
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    metrics = Metrics(engine_loop, lambda: tokenizer_backlog)
    if allowed_hosts:  # added last: it sees every request first
        app.add_middleware(_HostCheck, hosts=allowed_hosts, refused=metrics.errors.labels("400").inc)
    app.state.engine_loop = engine_loop
    app.state.prompt_scorer = score_prompt
    app.state.corpora = corpora

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        metrics.errors.labels(str(error.status)).inc()
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:  # an unknown route or method
        metrics.errors.labels(str(error.status_code)).inc()
        return APIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def server_error(_: Request, error: Exception) -> JSONResponse:  # a fault of ours: said as OpenAI says it
        traceback.print_exception(error)
        metrics.errors.labels("500").inc()
        failure = APIError(500, f"the server failed on this request ({type(error).__name__}: {error})",
                           kind="server_error")
        return JSONResponse(failure.body(), status_code=500)

    def authorise(request: Request) -> str | None:
        if not api_keys:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip()
        # Compared in a time that does not tell how much of a key a guess got right.
        matches = [hmac.compare_digest(given.encode(), key.encode()) for key in api_keys]
        if scheme.lower() != "bearer" or not any(matches):
            problem = "invalid API key" if given else "no API key (no Authorization header, or an empty one)"
            raise APIError(401, f"{problem}: pass one of the server's --api-key values as a Bearer token "
                           "(Authorization: Bearer KEY)", kind="authentication_error", code="invalid_api_key")
        return given

    def served(model_id: str) -> None:
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}", "model",
                           "not_found_error", "model_not_found")

    def refuse(body: RequestBody) -> None:
        """400 (404 for another model) for what this server cannot answer as asked."""
        served(body.model)
        if body.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        body.refuse_unsupported()
        body.stop_strings()

    def new_tokens(body: RequestBody, prompt: torch.Tensor) -> int:
        """The most tokens to generate: the client's max_tokens if prompt + it fits the engine's max_length;
        without one, the request type's default where it fits, else what is left of max_length, so that any
        prompt that fits gets a reply. 400 naming the field at fault otherwise."""
        where, size = body.PROMPT_FIELD, prompt.numel()
        if size == 0:
            raise APIError(400, f"{where} must not be empty", where)
        room = engine.max_length - size
        limit, asked = body.token_limit()
        if asked == 0 and not body.echoes():
            raise APIError(400, f"{limit} must be at least 1 (0 only with a text completion's echo: the prompt "
                                "scored, nothing generated)", limit)
        scored_only = asked == 0  # the prompt alone must fit
        if room < (0 if scored_only else 1):
            raise APIError(400, f"{where} is {size} tokens long: {'it' if scored_only else 'with a token of reply it'} "
                                f"exceeds the server's max_length of {engine.max_length} positions", where,
                           code="context_length_exceeded")
        if asked is None:
            return min(body.DEFAULT_TOKENS or room, room)
        if asked > room:
            raise APIError(400, f"the prompt ({size} tokens) + {limit} ({asked}) exceeds the server's max_length of "
                                f"{engine.max_length} positions; {limit} can be at most {room} for this prompt", limit,
                           code="context_length_exceeded")
        return asked

    def params_of(body: RequestBody, key: str | None, prompt: torch.Tensor) -> RequestParams:
        if corpus_megabytes and key not in corpora:
            corpora[key] = Corpus(max_megabytes=corpus_megabytes)
        corpus = corpora.get(key)
        penalties = OpenAIPenalties.of(body, prompt.numel(), vocabulary_size(model))
        stops = [stop for stop in body.stop_strings() if stop]
        sampled = body.temperature >= GREEDY_BELOW
        return RequestParams(max_new_tokens=new_tokens(body, prompt), config=_lookahead_config(body.lookahead),
                             do_sample=sampled, temperature=body.temperature if sampled else None,
                             top_p=body.top_p or 1.0, top_k=1 if body.top_p == 0 else max(body.top_k, 0),
                             seed=body.seed if sampled else None,
                             corpus=corpus, output_logits=body.logprobs_asked() is not None,
                             logits_processor=[penalties] if penalties is not None else None,
                             stopping_criteria=[_ReplyStop(tokenizer, stops, prompt)] if stops else None)

    async def run(request: Request, body: RequestBody, prompt: torch.Tensor, params: RequestParams, chat: bool,
                  text: str = "", alone: bool = True):
        """One prompt's reply (`text`: its text, which `echo` repeats; `alone`: the request's only prompt, which
        counts the request in the metrics once it is accepted)."""
        stops = body.stop_strings()
        started = time.time()
        arrived = time.perf_counter()
        echoed = text if body.echoes() else ""
        top = body.logprobs_asked()
        logprobs = _Logprobs(tokenizer, top) if top is not None else None
        rid, stream = await engine_loop.add(prompt, params, top) if params.max_new_tokens else (None, None)
        if echoed and logprobs is not None:  # the reply's tokens meanwhile wait in `stream`
            try:
                # Behind other prompts, perhaps: a client that leaves meanwhile frees its slot now, not once scored.
                scores = await _unless_disconnected(request, score_prompt(prompt))
            except BaseException:
                if rid is not None:
                    engine_loop.abort(rid)
                raise
            if scores is None:  # the client has gone: nobody reads this
                if rid is not None:
                    engine_loop.abort(rid)
                return Response(status_code=499)
            logprobs.add_prompt(prompt.tolist(), scores, echoed)
        if alone:
            metrics.requests.labels("chat" if chat else "completions").inc()
        metrics.prompt_tokens.inc(prompt.numel())
        reply = _Reply(tokenizer, stops, eos_ids(model, params.eos_token_id),
                       reply_context(tokenizer, prompt.tolist()))
        steps = 0  # decoding steps that gave this request tokens
        name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        usage = lambda: {"prompt_tokens": prompt.numel(), "completion_tokens": reply.tokens,  # noqa: E731
                         "total_tokens": prompt.numel() + reply.tokens}

        async def outputs() -> AsyncIterator[str]:
            """The reply's text pieces; ends when the request finishes or a stop string is met. Raises the
            APIError of an engine failure."""
            nonlocal steps
            last = None
            if stream is None:  # echo alone: nothing to generate
                return
            try:
                while True:
                    delivery = await stream.queue.get()
                    if isinstance(delivery, APIError):
                        raise delivery
                    output, scored = delivery
                    now = time.perf_counter()
                    if logprobs is not None and scored is not None:
                        logprobs.add(output.tokens, scored)
                    before = reply.tokens
                    piece = reply.add(output.tokens, output.finished)
                    kept = reply.tokens - before  # the step's tokens up to a stop string's cut: the reply's
                    if kept:
                        # Tokens of one step arrive together: they share its interval. Those that came with the
                        # first token had none: they count in no interval, rather than as intervals of 0 s
                        # that would flatter lookahead, whose first step often brings several.
                        gaps = [] if last is None else [(now - last) / kept] * kept
                        if last is None:
                            metrics.first_token.observe(now - arrived)
                        for gap in gaps:
                            metrics.inter_token.observe(gap)
                        last = now
                        steps += 1
                        metrics.tokens.inc(kept)
                    done = reply.stopped or output.finished
                    if done and steps:  # ended by the engine or by a stop string; not a client that went away
                        metrics.tokens_per_step.observe(reply.tokens / steps)
                    if piece:
                        yield piece
                    if done:
                        return
            finally:  # a finished request is gone already; a stop string ends it, a client gone drops it
                if reply.stopped:
                    engine_loop.finish(rid, reply.tokens)
                else:
                    engine_loop.abort(rid)

        sent = 0  # tokens whose log-probabilities a chunk carried

        def chunk(piece: str | None, finish: str | None) -> dict:
            nonlocal sent
            choice = ({"index": 0, "delta": ({"content": piece} if piece is not None else {}), "finish_reason": finish}
                      if chat else {"index": 0, "text": piece or "", "finish_reason": finish})
            choice["logprobs"] = None
            if logprobs is not None:  # those of the tokens that came since the last chunk, the text maybe later
                echoed_tokens = logprobs.echoed
                if reply.tokens > sent:
                    choice["logprobs"] = logprobs.body(chat, echoed_tokens + sent, echoed_tokens + reply.tokens)
                sent = reply.tokens
            event = {"id": name, "object": f"{kind}.chunk" if chat else kind, "created": int(started),
                     "model": model_name, "choices": [choice]}
            if body.stream_options is not None and body.stream_options.include_usage:
                event["usage"] = None  # as OpenAI's chunks before the last, which holds the usage
            return event

        if body.stream:
            async def events() -> AsyncIterator[str]:
                if chat:
                    first = chunk(None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield f"data: {json.dumps(first)}\n\n"
                if echoed:
                    prompt_chunk = chunk(echoed, None)
                    if logprobs is not None:
                        prompt_chunk["choices"][0]["logprobs"] = logprobs.body(chat, 0, logprobs.echoed)
                    yield f"data: {json.dumps(prompt_chunk)}\n\n"
                try:
                    async for piece in outputs():
                        if await request.is_disconnected():
                            return
                        event = chunk(piece, None)
                        # Our extension, clients ignore it: the reply's tokens and steps so far.
                        event["lookahead"] = {"tokens": reply.tokens, "steps": steps}
                        yield f"data: {json.dumps(event)}\n\n"
                except APIError as error:  # the status is sent already: an error event ends the stream, no finish
                    metrics.errors.labels(str(error.status)).inc()
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                finish = chunk(None, reply.finish_reason)
                # The progress again: a last step whose tokens make no text (an end-of-sequence token alone) is
                # counted here, or a client counting by the events with text would miss it.
                finish["lookahead"] = {"tokens": reply.tokens, "steps": steps}
                yield f"data: {json.dumps(finish)}\n\n"
                if body.stream_options is not None and body.stream_options.include_usage:
                    last = chunk(None, None)
                    last["choices"], last["usage"] = [], usage()
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            # Not cached, nor held back by a proxy (nginx buffers a reply unless told not to): each event as it comes.
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text = await _unless_disconnected(request, _joined(outputs()))
        if text is None:
            return Response(status_code=499)  # the client has gone: nobody reads this
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reply.finish_reason}
                  if chat else {"index": 0, "text": echoed + text, "finish_reason": reply.finish_reason})
        choice["logprobs"] = None if logprobs is None else logprobs.body(chat, 0, logprobs.echoed + reply.tokens)
        return {"id": name, "object": kind, "created": int(started), "model": model_name, "choices": [choice],
                "usage": usage()}

    async def answer(request: Request, schema: type[RequestBody]):
        key = authorise(request)  # before the body is read: without a key, a malformed body gets 401 too
        body = await _parse(request, schema)
        refuse(body)
        chat = schema is ChatRequest
        count = body.prompt_count()
        if count > max_batch + max_queue:  # a 429 would never pass: they could not all get in at once
            raise APIError(400, f"prompt holds {count} prompts; this server takes at most {max_batch + max_queue}"
                                " in one request (--max-batch + --max-queue)", "prompt")
        # A text that cannot fit is refused untokenized: tokenizing megabytes takes seconds, on the one thread that
        # every request's prompt waits for. Its tokens are at least its characters over the longest piece's (a
        # tokenizer's normalising may shorten a text: TEXT_SLACK times that, to refuse none that could fit).
        if body.text_size() > TEXT_SLACK * piece_characters * engine.max_length:
            raise APIError(400, f"{body.PROMPT_FIELD} holds {body.text_size()} characters of text: far more tokens "
                                f"than the server's max_length of {engine.max_length} positions (this tokenizer's "
                                f"pieces are at most {piece_characters} characters long)", body.PROMPT_FIELD,
                           code="context_length_exceeded")
        # Tokenizing a long prompt takes a while: on a thread of its own, the event loop streams other replies
        # meanwhile (one thread: a tokenizer is not made to be called from several at once). As many requests as
        # the engine takes may wait for it; more get 429, as they would once tokenized (they had waited unbounded).
        nonlocal tokenizer_backlog
        if tokenizer_backlog >= max_batch + max_queue:
            raise _server_full(max_batch, max_queue)
        tokenizer_backlog += 1
        try:
            encoded = await asyncio.get_running_loop().run_in_executor(
                tokenizing, body.prompts, tokenizer, vocabulary_size(model))
        finally:
            tokenizer_backlog -= 1
        prompts = [(ids, text, params_of(body, key, ids)) for ids, text in encoded]  # all checked before any decodes
        if len(prompts) == 1:
            return await run(request, body, *prompts[0][::2], chat=chat, text=prompts[0][1])
        if body.stream:
            raise APIError(400, "a streamed completion takes one prompt; send the others as requests of their own",
                           "prompt")
        try:
            async with asyncio.TaskGroup() as group:  # one failing ends the others
                tasks = [group.create_task(run(request, body, ids, params, chat=chat, text=text, alone=False))
                         for ids, text, params in prompts]
        except ExceptionGroup as failed:
            raise next((e for e in failed.exceptions if isinstance(e, APIError)), failed.exceptions[0]) from None
        metrics.requests.labels("chat" if chat else "completions").inc()  # once for its prompts, all answered
        replies = [task.result() for task in tasks]
        gone = next((reply for reply in replies if isinstance(reply, Response)), None)
        if gone is not None:  # the client left
            return gone
        merged = dict(replies[0], choices=[dict(r["choices"][0], index=i) for i, r in enumerate(replies)])
        merged["usage"] = {name: sum(r["usage"][name] for r in replies) for name in replies[0]["usage"]}
        return merged

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatRequest))
    async def chat_completions(request: Request):
        return await answer(request, ChatRequest)

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request):
        return await answer(request, CompletionRequest)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(CHAT_PAGE, headers=PAGE_HEADERS)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "lookahead"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(request: Request, model_id: str):
        authorise(request)
        served(model_id)
        return card

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        if not engine_loop.alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok", "running": engine.running(), "waiting": engine.waiting()}

    _document_bodies(app, (ChatRequest, CompletionRequest))
    return app


# What a browser on this machine calls a server on it.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def hosts_to_allow(bind: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The Host names a server listening on `bind` answers (empty: any), `extra` beside them ("*": any). One
    on the loopback address answers its loopback names alone: a web page of another site whose name it has
    pointed at 127.0.0.1 (DNS rebinding) would otherwise read the server's replies as a page of its own."""
    extra = tuple(extra)
    if "*" in extra:
        return ()
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:  # a name other than localhost
        loopback = False
    return LOOPBACK_HOSTS + extra if loopback else extra


def _host_name(host: str) -> str:
    """A Host header's (or an allowed host's) name, without its port: [::1]:8000 -> ::1."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class _HostCheck:
    """Answers 400 to a request addressed to a Host outside `hosts` (a plain ASGI middleware: one built on
    Starlette's BaseHTTPMiddleware would hide a streaming client's disconnection)."""

    def __init__(self, app: Callable, hosts: tuple[str, ...], refused: Callable[[], None]) -> None:
        self.app, self.hosts, self.refused = app, {_host_name(host) for host in hosts}, refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if _host_name(host) not in self.hosts:
                refusal = APIError(400, f"this server answers requests addressed to {', '.join(sorted(self.hosts))}, "
                                        f"not to {host!r}; start it with --allow-host NAME to answer that name too")
                self.refused()
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _request_body(schema: type[RequestBody]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its JSON itself (`_parse`: OpenAI-style errors), which
    FastAPI therefore cannot describe."""
    reference = {"$ref": f"{_SCHEMAS}{schema.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": reference}}}}


_SCHEMAS = "#/components/schemas/"


def _document_bodies(app: FastAPI, schemas: tuple[type[RequestBody], ...]) -> None:
    """Put the request bodies that `_request_body` refers to, and the models they nest, in the app's OpenAPI
    document."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = build().setdefault("components", {}).setdefault("schemas", {})
            for schema in schemas:
                document = schema.model_json_schema(ref_template=_SCHEMAS + "{model}")
                components.update(document.pop("$defs", {}))
                components[schema.__name__] = document
        return app.openapi_schema

    app.openapi = openapi


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
    """A reply's text as tokens arrive: decoded a few tokens at a time (a reply of 4000 tokens decoded whole at
    each step spent 0.59 s in the tokenizer), released up to the last complete character, cut at the first
    stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str], stop_ids: Iterable[int] = (),
                 context: list[int] = ()) -> None:
        self.tokenizer, self.stops, self.stop_ids = tokenizer, [s for s in stops if s], set(stop_ids)
        self.context = list(context)  # the prompt's last tokens, which the reply's first ones are decoded after
        self.ids: list[int] = []
        self.text = ""  # the text of every token so far whose characters are complete
        self.sent = ""
        self.stopped = False
        self._through_stop: int | None = None  # where a stop string cut the reply: the tokens up to its end
        # `text` is that of ids[:_read]; new tokens are decoded after the tokens from _window on, whose text
        # is then subtracted: a tokenizer may decode a token differently at the start of a text (SentencePiece
        # drops a word's leading space there) and a character may span tokens.
        self._window = self._read = 0

    @property
    def tokens(self) -> int:
        """The reply's tokens (`usage.completion_tokens`): where a stop string cut it, those up to the one that
        completed the stop string; the engine's tokens past it are not the reply's."""
        return len(self.ids) if self._through_stop is None else self._through_stop

    @property
    def finish_reason(self) -> str:
        """Once the reply is over: "stop" if a stop string or a stop token (EOS) ended it, "length" if the token
        limit cut it (the engine ends a request no other way)."""
        return "stop" if self.stopped or (bool(self.ids) and self.ids[-1] in self.stop_ids) else "length"

    def add(self, tokens: list[int], finished: bool = False) -> str:
        """The text to send after these tokens. Until the request has finished, a character cut in the middle
        and a tail that may be the start of a stop string wait for the next tokens: text once sent cannot be
        taken back when a stop string completes across two steps."""
        # `text` holds the tokens before `_read` (those of an earlier step may wait on a split character): a stop
        # string found in what it gains was completed by a token after them, and ends in that new text.
        settled, known = self._read, len(self.text)
        self.ids.extend(tokens)
        self._decode_new(finished)
        searched = self.text[max(0, known - max(map(len, self.stops), default=0) + 1):]
        if not self.stopped and any(stop in searched for stop in self.stops):
            # None where the whole text, decoded again, does not hold it (a tokenizer whose pieces do not add up)
            self._through_stop = next((n for n in range(settled + 1, len(self.ids) + 1) if self._cut(n) is not None),
                                      None)
            self.stopped = self._through_stop is not None
        text = self.text
        if self.stopped:  # as if the tokens had come one at a time: cut where the first to complete does
            text = self._cut(self._through_stop)
        elif not finished:
            text = text[:len(text) - _stop_started(text, self.stops)]
        piece, self.sent = text[len(self.sent):], text
        return piece

    def _decode(self, start: int, end: int | None = None) -> str:
        """The text of the reply's tokens start..end, read after the tokens before them (the prompt's at the start)."""
        return _text_after(self.tokenizer, self.context if start == 0 else [], self.ids[start:end])

    def _decode_new(self, finished: bool) -> None:
        """Extend `text` by the new tokens' complete characters (all of them once `finished`)."""
        settled = self._decode(self._window, self._read)
        grown = self._decode(self._window)
        if len(grown) > len(settled) and (finished or not grown.endswith("\ufffd")):
            self.text += grown[len(settled):]
            self._window, self._read = self._read, len(self.ids)

    def _cut(self, count: int) -> str | None:
        """The text of the first `count` tokens up to the earliest stop string in it; None if it has none."""
        text = self._decode(0, count)
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        return text[:min(found)] if found else None


class _ReplyStop(StoppingCriteria):
    """Ends a request at the token that completes a stop string in its reply's text, where `_Reply` cuts it,
    so that the engine decodes nothing past the cut (nor gives it to the corpus) when the request's reader
    sees the cut a step later or the same step ends the request at max_tokens. Only the reply's last tokens
    are decoded: a stop string in their text is in the whole reply's too (decoding from a later token only
    drops characters in front), and one spread over more tokens is left to the reader."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str], prompt: torch.Tensor) -> None:
        self.tokenizer, self.stops, self.prompt_length = tokenizer, stops, prompt.numel()
        self.context = reply_context(tokenizer, prompt.tolist())  # as `_Reply` reads the reply's start
        self.window = 2 * max(map(len, stops)) + 4  # tokens: most pieces hold a character or more

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        reply = input_ids[0, self.prompt_length:]
        tail = reply[-self.window:].tolist()
        text = _text_after(self.tokenizer, self.context if len(tail) == reply.numel() else [], tail)
        return torch.tensor([any(stop in text for stop in self.stops)])


def _reply_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    # Without the legacy clean-up of spaces (" ." -> "."), which a later token can undo in text already sent;
    # the same decoding for pieces and stop strings.
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# The prompt's last tokens a reply is decoded after, as vLLM primes its detokenizer with the prompt's last 5.
REPLY_CONTEXT = 4


def reply_context(tokenizer: PreTrainedTokenizerBase, prompt: list[int]) -> list[int]:
    """The prompt's last tokens, which a reply's text is read after (`_text_after`); none where they end inside a
    character (a prompt of token ids cut there), whose completion by the reply the subtraction would lose."""
    context = prompt[-REPLY_CONTEXT:]
    return [] if _reply_text(tokenizer, context).endswith("\ufffd") else context


def _text_after(tokenizer: PreTrainedTokenizerBase, context: list[int], ids: list[int]) -> str:
    """The text of `ids` as it reads after the tokens `context`: a SentencePiece decoder (Llama 2's, Mistral's)
    drops a word's leading space at the start of a text, which a reply's first word keeps after its prompt
    ("world," then " the", not "the")."""
    if not context:
        return _reply_text(tokenizer, ids)
    return _reply_text(tokenizer, context + ids)[len(_reply_text(tokenizer, context)):]


def _stop_started(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that a stop string starts with (and is longer than): that end
    may yet become a stop string, so it is held back."""
    longest = 0
    for stop in stops:
        tail = text[max(0, len(text) - len(stop) + 1):] if len(stop) > 1 else ""
        at = tail.find(stop[:1])  # only where the stop string's first character is may it have started
        while at >= 0 and len(tail) - at > longest:
            if stop.startswith(tail[at:]):
                longest = len(tail) - at
                break
            at = tail.find(stop[:1], at + 1)
    return longest


class _Logprobs:
    """A reply's log-probabilities: each token's under the model (the log-softmax of its float32 logits,
    before temperature and top_p, as vLLM reports them by default) and the `top` likeliest tokens at each
    position, in OpenAI's formats."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top: int) -> None:
        self.tokenizer, self.top = tokenizer, top
        self.byte_level = decodes_byte_level(tokenizer)
        self.chosen: list[tuple[int, float | None]] = []
        self.likeliest: list[list[tuple[int, float]] | None] = []
        self.offsets = [0]  # of each token's text in the reply's, and where the next one's would start
        self._characters = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a character's first bytes
        self.echoed = 0  # the prompt's tokens, first (`add_prompt`): indices below count them
        # What the reply's text leaves out (`_reply_text`): every added token marked special, not only those named
        # (SmolLM2's <file_sep>, <repo_name>, ...).
        self._special = frozenset(tokenizer.all_special_ids) | {
            i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}

    def add_prompt(self, tokens: list[int], logits: torch.Tensor, text: str) -> None:
        """An echoed prompt's tokens, before any of the reply's: the first has no log-probability (nothing
        before it), each other one's from `logits` ([len(tokens) - 1, vocab]: after each token but the last).
        `text`: the prompt's echoed text. Where the tokenizer finds these tokens in it, their offsets are where it
        found them: a BOS token it added, or the space SentencePiece puts before the first word, is no character
        of the text, and counted by the tokens' own texts they had moved every offset after them."""
        self.chosen.append((tokens[0], None))
        self.likeliest.append(None)
        self._score(tokens[1:], _TokenLogprobs.of(tokens[1:], logits, self.top))
        found = _offsets_in(self.tokenizer, text, tokens)
        if found is None:
            self._add_texts(tokens, reply=False)
        else:
            self.offsets = found + [len(text)]
        self.echoed = len(tokens)

    def add(self, tokens: list[int], scored: _TokenLogprobs) -> None:
        """The reply's next tokens, with their log-probabilities."""
        self._score(tokens, scored)
        self._add_texts(tokens, reply=True)

    def _score(self, tokens: list[int], scored: _TokenLogprobs) -> None:
        self.chosen += zip(tokens, scored.chosen)
        self.likeliest += scored.likeliest

    def _add_texts(self, tokens: list[int], reply: bool) -> None:
        """Offsets in characters: a token that ends inside a character adds none, the one that completes it one,
        and in the reply a special token none (its text leaves them out, `_reply_text`; an echoed prompt's keeps
        them)."""
        for token in tokens:
            if reply and token in self._special:
                self.offsets.append(self.offsets[-1])
                continue
            raw = token_bytes(self.tokenizer, token, self.byte_level)
            self.offsets.append(self.offsets[-1] + len(self._characters.decode(raw)))

    def body(self, chat: bool, start: int, end: int) -> dict:
        """The `logprobs` of a choice for the tokens start..end (an echoed prompt's first, then the reply's)."""
        chosen, likeliest = self.chosen[start:end], self.likeliest[start:end]
        if chat:
            return {"content": [{**self._token(t, p), "top_logprobs": [self._token(i, v) for i, v in top]}
                                for (t, p), top in zip(chosen, likeliest)], "refusal": None}
        # A completion's top_logprobs hold the chosen token too, as OpenAI's and vLLM's (up to logprobs + 1 entries;
        # the chosen one alone for logprobs 0); chat's top_logprobs do not.
        names = [self._token(t, p)["token"] for t, p in chosen]
        return {"tokens": names, "token_logprobs": [p for _, p in chosen],
                "top_logprobs": [None if top is None else {**{self._token(i, v)["token"]: v for i, v in top}, name: p}
                                 for name, (_, p), top in zip(names, chosen, likeliest)],
                "text_offset": self.offsets[start:end]}

    def _token(self, token: int, logprob: float | None) -> dict:
        """A token as OpenAI writes it; one holding part of a character as its bytes ("bytes:\\xf0\\x9f"), so
        that two such tokens never share a name (a key of a completion's top_logprobs)."""
        raw = token_bytes(self.tokenizer, token, self.byte_level)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(chr(byte) if 32 <= byte < 127 and byte != 92 else f"\\x{byte:02x}"
                                      for byte in raw)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _offsets_in(tokenizer: PreTrainedTokenizerBase, text: str, tokens: list[int]) -> list[int] | None:
    """Where each of `tokens` starts in `text`, by the offsets a fast tokenizer reports; a token it added (a BOS)
    starts where the text before it ends. None where the tokenizer has no offsets or makes other tokens of the
    text (a prompt given as token ids that do not spell their decoded text back)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    encoded = tokenizer(text, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != tokens:
        return None
    starts, end = [], 0
    for start, stop in encoded["offset_mapping"]:
        # An added token has no span, (0, 0); the pieces of one character share its span, and those before the
        # piece that completes it start where it does (as `_Logprobs._add_texts` counts a reply's).
        starts.append(max(start, starts[-1] if starts else 0) if stop > start else end)
        end = max(end, stop)
    return starts


class _PromptScorer:
    """The model's float32 logits after each token of an echoed prompt but the last ([n - 1, vocab]), from
    transformers' own forward on a worker thread (the engine's steps go on meanwhile). One prompt at a time: the
    logits of a 4096-token prompt take 800 MB; where `max_waiting` wait already, a request gets `full()` (429)."""

    def __init__(self, model: PreTrainedModel, max_waiting: int, full: Callable[[], APIError]) -> None:
        self.model, self.max_waiting, self.full = model, max_waiting, full
        self.waiting = 0
        self.lock = asyncio.Lock()

    async def __call__(self, prompt: torch.Tensor) -> torch.Tensor:
        if self.lock.locked() and self.waiting >= self.max_waiting:
            raise self.full()
        self.waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.waiting -= 1
        # Held until the forward ends, even where the client has gone meanwhile (its thread cannot be stopped).
        work = asyncio.ensure_future(asyncio.to_thread(self._logits, prompt))
        work.add_done_callback(lambda _: self.lock.release())
        return await asyncio.shield(work)

    def _logits(self, prompt: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            ids = prompt.view(1, -1).to(self.model.device)
            return self.model(input_ids=ids, use_cache=False).logits[0, :-1].float().cpu()


@functools.cache
def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet (a printable character per byte), read back to bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def decodes_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's pieces are in GPT-2's byte-level alphabet (its decoder, or one of them, says so)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return False
    decoder = json.loads(decoder.__getstate__())  # its settings alone, in microseconds
    return decoder.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) if isinstance(d, dict))


def token_bytes(tokenizer: PreTrainedTokenizerBase, token: int, byte_level: bool) -> bytes:
    """A token's own bytes (a token may hold part of a character): a byte-level BPE piece (`byte_level`, as
    `decodes_byte_level` says) read through GPT-2's alphabet, a byte-fallback piece (<0x0A>) as its byte, a SentencePiece word start as a space, else its text."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str):
        return b""
    if byte_level:
        alphabet = _byte_level()
        if all(character in alphabet for character in piece):
            return bytes(alphabet[character] for character in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token]).encode()


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties and logit bias: a token's logit less `frequency` for each time
    it came in the reply so far (not the prompt), less `presence` once it came at all, plus its bias."""

    def __init__(self, prompt_length: int, frequency: float, presence: float, bias: dict[int, float]) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32)

    @classmethod
    def of(cls, body: RequestBody, prompt_length: int, vocabulary: int) -> OpenAIPenalties | None:
        """The request's penalties (None where it sets none); 400 for a logit bias of a token not in the model's
        vocabulary or of more than 100 either way."""
        bias = {}
        for key, value in (body.logit_bias or {}).items():  # the length first: int() refuses 4301 digits
            if not (key.isascii() and key.isdigit()) or len(key) > len(str(vocabulary)) or int(key) >= vocabulary:
                raise APIError(400, f"logit_bias keys must be token ids in [0, {vocabulary}), got {key!r}", "logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                               "logit_bias")
            bias[int(key)] = value
        if not (body.frequency_penalty or body.presence_penalty or any(bias.values())):
            return None
        return cls(prompt_length, body.frequency_penalty, body.presence_penalty, bias)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        reply = input_ids[:, self.prompt_length :]
        if (self.frequency or self.presence) and reply.numel():
            counts = torch.zeros_like(scores).scatter_add_(1, reply, torch.ones_like(reply, dtype=scores.dtype))
            scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        if self.bias_ids.numel():
            scores = scores.index_add(1, self.bias_ids.to(scores.device),
                                      self.bias.to(scores).expand(scores.shape[0], -1))
        return scores
