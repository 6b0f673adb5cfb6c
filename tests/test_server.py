"""`lookahead serve`, driven through the official `openai` client on loopback, on the real default model:
greedy replies equal `generate`, streams and plain replies agree, concurrent streams each equal their
request alone, a client that goes away frees its slot, bad requests get OpenAI-style 4xx errors, an engine
failure an OpenAI-style 500."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

import openai
import pytest
import torch
from conftest import reference_greedy

from lookahead.bench.serve import stream_chat
from lookahead.prompts import encode_messages
from lookahead.serve import LOOPBACK_HOSTS, ChatRequest, CompletionRequest, create_app, hosts_to_allow, serve_in_thread

pytestmark = pytest.mark.slow

KEYS = ("key-a", "key-b")
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(default_model):
    model, tokenizer = default_model
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=4, max_queue=40, max_length=1024, api_keys=KEYS,
                     allowed_hosts=hosts_to_allow("127.0.0.1"))  # as `lookahead serve` does on 127.0.0.1
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture(autouse=True)
def settled_after(request):
    """After each test on the shared server, wait until its engine has ended every request: one that a stop
    string ended is handed back to the engine after the reply, and would count as running in the next test."""
    yield
    if "server" in request.fixturenames:
        _settled(request.getfixturevalue("server")[1])


def raw(url: str, body: dict | bytes | None = None, key: str = KEYS[1], headers: dict[str, str] | None = None
        ) -> tuple[int, dict]:
    """An HTTP request without the openai client (which would refuse some malformed bodies itself); bytes are
    sent as they are, `headers` beside (or instead of) the key and the JSON content type."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {key}",
                                                              "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def preflight(url: str, origin: str) -> tuple[int, str | None]:
    """A browser's CORS preflight of a chat completion from a page of `origin` (with the openai JS client's own
    headers): the status and the origin allowed."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", method="OPTIONS", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers["Access-Control-Allow-Origin"]
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Access-Control-Allow-Origin"]


def greedy_text(default_model, question: str, tokens: int) -> str:
    model, tokenizer = default_model
    ids = encode_messages(tokenizer, [{"role": "user", "content": question}])
    expected = reference_greedy(model, ids, tokens)[0, ids.shape[1]:]
    return tokenizer.decode(expected, skip_special_tokens=True)


def test_a_developer_message_is_the_system_message(server, default_model):
    """OpenAI's newer clients send the system prompt as "developer", which chat templates do not know."""
    url, _ = server
    model, tokenizer = default_model
    turns = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]
    ids = encode_messages(tokenizer, turns)
    expected = tokenizer.decode(reference_greedy(model, ids, 8)[0, ids.shape[1]:], skip_special_tokens=True)
    reply = client(url).chat.completions.create(
        model=MODEL, messages=[{**turns[0], "role": "developer"}, turns[1]], max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == ids.shape[1]  # the very prompt the system message makes


def test_chat_reply_equals_generate_streamed_or_not(server, default_model):
    url, _ = server
    question = "Name three colours of the rainbow."
    expected = greedy_text(default_model, question, 24)
    messages = [{"role": "user", "content": question}]
    reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 5
    stream = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens  # the usage chunk comes last
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_text_completion_and_stop_strings(server, default_model):
    url, _ = server
    model, tokenizer = default_model
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(reference_greedy(model, ids, 20)[0, ids.shape[1]:], skip_special_tokens=True)
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert reply.choices[0].text == expected
    stop = expected.strip()[3:6]
    cut = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected[: expected.find(stop)] and cut.choices[0].finish_reason == "stop"
    # Usage counts the tokens up to the one that completed the stop string, not those decoded past it.
    generated = reference_greedy(model, ids, 20)[0, ids.shape[1]:].tolist()
    through = next(n for n in range(1, 21) if stop in tokenizer.decode(generated[:n], skip_special_tokens=True))
    assert through < 20 and cut.usage.completion_tokens == through


def test_a_stop_string_that_ends_the_prompt_cuts_the_reply_alone(server, default_model):
    """The engine ends a request at a stop string of its reply's text, not one that the prompt's end and the
    reply's first token make (or the prompt alone): the reply goes on to its own first stop string."""
    url, _ = server
    model, tokenizer = default_model
    prompt = "Count: one, two,"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(reference_greedy(model, ids, 12)[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.find(",") > 1  # a word before the reply's first comma
    cut = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[","])
    assert cut.choices[0].text == expected[: expected.find(",")] and cut.choices[0].finish_reason == "stop"


def test_thirty_two_concurrent_streams_each_equal_their_request_alone(server, default_model):
    url, _ = server
    questions = [f"Write one sentence about the number {i}." for i in range(32)]

    def ask(question: str) -> str:
        stream = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(ask, questions))
    assert replies == [greedy_text(default_model, q, 12) for q in questions]


def test_a_client_that_leaves_frees_its_slot(server):
    url, app = server
    engine = app.state.engine_loop.engine
    stream = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a very long story."}], max_tokens=900, stream=True)
    chunks = iter(stream)
    while not next(chunks).choices[0].delta.content:  # the first chunk (the role) comes before any token
        pass
    assert engine.running() == 1
    stream.close()
    deadline = time.time() + 20
    while engine.running() and time.time() < deadline:
        time.sleep(0.1)
    assert engine.running() == 0


def test_a_stalled_stream_with_logprobs_holds_no_row_of_the_vocabulary():
    """Outputs wait in a stream for a reader that has fallen behind (a client that stopped reading): with logprobs,
    each with a few numbers a token, cut from the logits on the engine's thread. They had each held the step's
    [tokens, vocab] float32 logits (a review measured 1.8 GB over four streams of 4,000 tokens, 49,152 ids)."""
    from conftest import make_tiny_model

    from lookahead import LookaheadConfig
    from lookahead.engine import Engine, RequestParams
    from lookahead.serve import EngineLoop

    llama_tiny = make_tiny_model("llama")  # a model of its own: no other test's engine thread runs on it
    reference = reference_greedy(llama_tiny, torch.tensor([[5, 6, 7, 8]]), 12, eos_token_id=[])
    with torch.inference_mode():  # (a reference computed afresh is an inference tensor, which autograd refuses)
        logits = llama_tiny(reference).logits[0, 3:-1]
    expected = torch.log_softmax(logits.float(), dim=-1)

    async def unread() -> list:
        engine_loop = EngineLoop(Engine(llama_tiny, max_batch=1), max_queue=1)
        try:
            params = RequestParams(max_new_tokens=12, eos_token_id=[], output_logits=True,
                                   config=LookaheadConfig(4, 3, 4))
            _, stream = await engine_loop.add(torch.tensor([5, 6, 7, 8]), params, top=2)
            deadline = time.monotonic() + 60
            while engine_loop.engine.has_unfinished() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the last deliveries, handed to this loop
            return list(stream.queue._queue)
        finally:
            engine_loop.stop()

    waiting = asyncio.run(unread())
    assert sum(len(output.tokens) for output, _ in waiting) == 12 and waiting[-1][0].finished
    chosen = [value for output, scored in waiting for value in scored.chosen]
    likeliest = [top for output, scored in waiting for top in scored.likeliest]
    assert all(output.logits is None for output, _ in waiting)
    assert chosen == pytest.approx(expected.max(dim=-1).values.tolist(), abs=1e-4)  # greedy: the likeliest token
    assert [[token for token, _ in top] for top in likeliest] == expected.topk(2).indices.tolist()


HI = [{"role": "user", "content": "hi"}]
LONG = "word " * 1100  # over the server's max_length of 1024 tokens


def test_a_client_that_leaves_before_a_plain_reply_frees_its_slot(server, default_model, monkeypatch):
    """Without streaming, nothing is written until the reply is done: the server watches the connection."""
    url, app = server
    model, _ = default_model
    engine = app.state.engine_loop.engine
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)  # it would decode all 900 tokens
    before = engine.stats.new_tokens
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900}).encode()
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                           % (KEYS[0].encode(), len(body), body))
        deadline = time.time() + 20
        while engine.running() == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.running() == 1
    deadline = time.time() + 20
    while engine.running() and time.time() < deadline:
        time.sleep(0.1)
    assert engine.running() == 0
    assert engine.stats.new_tokens - before < 900  # aborted, not decoded to the end


@pytest.mark.parametrize(
    "path, body, status, words, param",
    [
        ("chat", {"model": MODEL}, 400, "messages", "messages"),
        ("chat", {"model": MODEL, "messages": "hi"}, 400, "messages", "messages"),
        ("chat", {"model": MODEL, "messages": HI, "n": 2}, 400, "n must be 1", "n"),
        ("chat", {"model": MODEL, "messages": HI, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
        ("chat", {"model": "gpt-9", "messages": HI}, 404, "gpt-9", "model"),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "max_length of 1024",
         "messages"),
        ("completions", {"model": MODEL, "prompt": LONG}, 400, "max_length of 1024", "prompt"),
        ("chat", {"model": MODEL, "messages": HI, "max_tokens": 1020}, 400, "max_tokens can be at most",
         "max_tokens"),
        ("chat", {"model": MODEL, "messages": HI, "max_completion_tokens": 1020}, 400,
         "max_completion_tokens can be at most", "max_completion_tokens"),
        ("chat", {"model": MODEL, "messages": HI, "lookahead": {"window": -1}}, 400, "window", "lookahead"),
        ("chat", {"model": MODEL, "messages": HI, "seed": 2**64, "temperature": 1}, 400, "less than or equal",
         "seed"),
        ("chat", {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}}, 400,
         "only allowed when stream is true", "stream_options"),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, 400, "a list of text parts",
         "messages[0].content"),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "'image_url'", "messages[0].content[1]"),
        ("chat", {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 21}, 400,
         "less than or equal to 20", "top_logprobs"),
        ("chat", {"model": MODEL, "messages": HI, "top_logprobs": 2}, 400, "top_logprobs needs logprobs set to true",
         "top_logprobs"),
        ("chat", {"model": MODEL, "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
         "not supported", "tools"),
        ("chat", {"model": MODEL, "messages": HI, "tool_choice": "required"}, 400, "not supported", "tool_choice"),
        ("chat", {"model": MODEL, "messages": HI, "response_format": {"type": "json_object"}}, 400, "not supported",
         "response_format"),
        ("chat", {"model": MODEL, "messages": HI, "repetition_penalty": 1.5}, 400, "repetition_penalty is not "
         "supported by this server: leave it out or set it to 1", "repetition_penalty"),
        ("completions", {"model": MODEL, "prompt": "hi", "min_p": 0.9}, 400, "min_p is not supported",
         "min_p"),
        ("chat", {"model": MODEL, "messages": HI, "modalities": ["text", "audio"]}, 400, "modalities is not "
         "supported", "modalities"),
        ("chat", {"model": MODEL, "messages": HI, "top_k": -2}, 400, "greater than or equal to -1", "top_k"),
        ("chat", {"model": MODEL, "messages": HI, "presence_penalty": 2.5}, 400, "less than or equal to 2",
         "presence_penalty"),
        ("chat", {"model": MODEL, "messages": HI, "logit_bias": {"the": 5}}, 400, "logit_bias keys must be token ids",
         "logit_bias"),
        ("chat", {"model": MODEL, "messages": HI, "logit_bias": {"\u00b2": 5}}, 400, "logit_bias keys must be token ids",
         "logit_bias"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 5}}, 400,
         "token ids in [0, 49152), got '99999999'", "logit_bias"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1" * 5000: 5}}, 400,
         "logit_bias keys must be token ids", "logit_bias"),
        ("chat", {"model": MODEL, "messages": HI, "logit_bias": {"5": 101}}, 400, "in [-100, 100], got 101.0 for token 5",
         "logit_bias"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400,
         "max_tokens must be at least 1 (0 only with a text completion's echo", "max_tokens"),
        ("chat", {"model": MODEL, "messages": HI, "max_tokens": 0}, 400,
         "max_tokens must be at least 1", "max_tokens"),
        ("chat", {"model": MODEL, "messages": HI, "max_tokens": 0, "echo": True}, 400,
         "echo is not supported", "echo"),
        ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "less than or equal to 5",
         "logprobs"),
        ("completions", {"model": MODEL, "prompt": "hi", "suffix": "bye"}, 400, "not supported", "suffix"),
        ("completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "not supported", "best_of"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_completion_tokens": 5}, 400, "text completions take "
         "max_tokens", "max_completion_tokens"),
        ("chat", {"model": MODEL, "messages": HI, "stream": "yes"}, 400, "valid boolean", "stream"),
        ("chat", {"model": MODEL, "messages": HI, "temperature": True}, 400, "valid number", "temperature"),
        ("chat", {"model": MODEL, "messages": HI, "n": 1.0}, 400, "valid integer", "n"),
        ("completions", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400,
         "valid boolean", "stream_options.include_usage"),
        ("chat", {"model": MODEL, "messages": HI, "stop": ["a", 3]}, 400, "a string or a list of strings", "stop"),
        ("chat", {"model": MODEL, "messages": HI, "stop": ["x"] * 17}, 400, "stop holds 17 strings; this server "
         "takes at most 16", "stop"),
        ("completions", {"model": MODEL, "prompt": "hi", "stop": "x" * 1001}, 400, "at most 1000 characters long, "
         "got one of 1001", "stop"),
        ("chat", {"model": MODEL, "messages": HI, "lookahead": {"window": "5"}}, 400, "object of integers",
         "lookahead"),
        ("chat", {"model": MODEL, "messages": [{"role": 1, "content": "hi"}]}, 400, "'user'", "messages[0].role"),
        ("chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400,
         "Input should be 'system', 'developer', 'user', 'assistant', 'tool' or 'function'", "messages[0].role"),
        # Unknown fields had been ignored: a misspelt max_tokens left the reply uncapped, vLLM's guided decoding
        # gave unconstrained text.
        ("chat", {"model": MODEL, "messages": HI, "max_token": 5}, 400,
         "unrecognized request field 'max_token' (this server takes OpenAI's chat completions fields", "max_token"),
        ("completions", {"model": MODEL, "prompt": "hi", "guided_json": {"type": "object"}}, 400,
         "unrecognized request field 'guided_json' (this server takes OpenAI's text completions fields", "guided_json"),
        ("chat", {"model": MODEL, "messages": HI, "suffix": "bye"}, 400, "unrecognized request field 'suffix'",
         "suffix"),
        ("completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "text"}}, 400,
         "unrecognized request field 'response_format'", "response_format"),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "nmae": "Ann"}]}, 400, "nmae",
         "messages[0].nmae"),
        ("chat", {"model": MODEL, "messages": HI, "stream": True, "stream_options": {"include_usgae": True}}, 400,
         "include_usgae", "stream_options.include_usgae"),
    ],
    ids=["no-messages", "messages-not-a-list", "n=2", "negative-max-tokens", "unknown-model", "oversized-messages",
         "oversized-prompt", "max-tokens-past-max-length", "max-completion-tokens-past-max-length", "bad-lookahead",
         "seed-past-64-bits", "stream-options-without-stream", "user-content-null", "image-part",
         "top-logprobs-past-20", "top-logprobs-without-logprobs", "tools", "tool-choice", "json-response-format",
         "repetition-penalty", "min-p", "audio-modality", "top-k-below-minus-1",
         "presence-penalty-past-2", "logit-bias-word", "logit-bias-superscript-digit",
         "logit-bias-past-vocabulary", "logit-bias-of-5000-digits", "logit-bias-past-100", "zero-tokens-without-echo",
         "zero-chat-tokens", "chat-echo",
         "completion-logprobs", "suffix", "best-of", "completion-max-completion-tokens", "stream-a-string",
         "temperature-a-boolean", "n-a-float", "include-usage-a-number", "stop-list-with-a-number", "seventeen-stops",
         "stop-of-1001-characters",
         "lookahead-window-a-string", "role-a-number", "unknown-role", "misspelt-field", "vllm-guided-json",
         "chat-suffix", "completion-response-format", "misspelt-message-field", "misspelt-stream-option"],
)
def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_keeps_serving(server, path, body, status,
                                                                                     words, param):
    url, _ = server
    code, reply = raw(f"{url}/v1/{path.replace('chat', 'chat/completions')}", body)
    assert code == status
    assert words in reply["error"]["message"] and reply["error"]["type"]
    assert reply["error"]["param"] == param
    assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})


def test_malformed_json_is_a_400_about_the_body(server):
    url, _ = server
    code, reply = raw(f"{url}/v1/chat/completions", b'{"model": "smollm2", "messages": [')
    assert code == 400
    assert "not valid JSON" in reply["error"]["message"] and reply["error"]["param"] is None


def test_null_means_the_default(server):
    """OpenAI's client sends null for options left unset (`temperature=None`)."""
    url, _ = server
    nulls = {name: None for name in ("temperature", "top_p", "n", "stream", "stream_options", "seed", "stop",
                                     "max_completion_tokens", "lookahead", "logprobs", "tools", "response_format")}
    code, reply = raw(f"{url}/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, **nulls})
    assert code == 200 and reply["usage"]["completion_tokens"] <= 2
    reply = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=None, top_p=None,
                                           seed=None, stop=None)
    assert reply.usage.completion_tokens <= 2


def test_fields_that_ask_for_nothing_more_are_accepted(server):
    url, _ = server
    harmless = {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
                "logit_bias": {}, "user": "someone", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
                "safety_identifier": "x", "prompt_cache_key": "k", "parallel_tool_calls": True,
                "prediction": {"type": "content", "content": "Hello"}}
    code, reply = raw(f"{url}/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1, **harmless})
    assert code == 200 and reply["usage"]["completion_tokens"] == 1
    code, reply = raw(f"{url}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "echo": False,
                                                "best_of": 1, "suffix": "", "user": "someone"})
    assert code == 200 and reply["usage"]["completion_tokens"] == 1


def test_replies_have_openais_shape_and_streams_pass_proxies_unbuffered(server):
    """Choices carry `logprobs: null` when none were asked, chunks before the usage chunk `usage: null` (OpenAI's
    shape); a stream says not to cache or buffer it, which a proxy such as nginx otherwise does."""
    url, _ = server
    for path, body in (("chat/completions", {"messages": HI}), ("completions", {"prompt": "Hi"})):
        code, reply = raw(f"{url}/v1/{path}", {"model": MODEL, "max_tokens": 2, **body})
        assert code == 200 and reply["choices"][0]["logprobs"] is None
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(
        {"model": MODEL, "messages": HI, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    ).encode(), headers={"Authorization": f"Bearer {KEYS[1]}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        headers, lines = response.headers, response.read().decode().splitlines()
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] <= 2
    assert events[-1]["choices"] == [] and all(e["choices"][0]["logprobs"] is None for e in events[:-1])


def test_text_parts_are_the_text_and_an_assistant_may_have_null_content(server):
    url, _ = server
    question = "Name three colours of the rainbow."

    def ask(messages: list[dict]) -> str:
        return client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                   temperature=0).choices[0].message.content

    plain = ask([{"role": "user", "content": question}])
    assert ask([{"role": "user", "content": [{"type": "text", "text": question}]}]) == plain
    # After tool calls an assistant's content is null: an empty turn.
    after = lambda content: [HI[0], {"role": "assistant", "content": content},  # noqa: E731
                             {"role": "user", "content": question}]
    assert ask(after(None)) == ask(after(""))


def test_without_max_tokens_a_prompt_that_fits_gets_what_is_left_of_the_context(server, default_model):
    """The server's default of 256 new tokens would not fit beside this prompt: the reply gets the 3 left."""
    url, _ = server
    _, tokenizer = default_model
    words = 1021
    while len(tokenizer("Hello" + " word" * words)["input_ids"]) > 1021:
        words -= 1
    prompt = "Hello" + " word" * words
    assert len(tokenizer(prompt)["input_ids"]) == 1021
    reply = client(url).completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert reply.usage.prompt_tokens == 1021 and 1 <= reply.usage.completion_tokens <= 3


def test_chat_with_a_tokenizer_without_a_chat_template_is_a_400(server, default_model, monkeypatch):
    """The messages' texts had been joined by lines, who said what lost (vLLM answers 400 too)."""
    url, _ = server
    _, tokenizer = default_model
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="has no chat template to lay out messages with") as refused:
        client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert refused.value.body["param"] == "messages"


def test_a_chat_template_that_refuses_the_messages_is_a_400(server, default_model, monkeypatch):
    url, _ = server
    _, tokenizer = default_model
    monkeypatch.setattr(tokenizer, "chat_template", (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}assistant:"))
    with pytest.raises(openai.BadRequestError, match="roles must alternate") as refused:
        client(url).chat.completions.create(model=MODEL, messages=HI + HI, max_tokens=2)
    assert refused.value.body["param"] == "messages"


def test_a_messages_name_and_tool_fields_reach_the_chat_template(server, default_model, monkeypatch):
    """`name`, `tool_calls` and `tool_call_id` are handed to the template (they had been dropped), as
    transformers' `apply_chat_template` takes them."""
    url, _ = server
    _, tokenizer = default_model
    monkeypatch.setattr(tokenizer, "chat_template", (
        "{% for m in messages %}{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}"
        "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}: {{ m['content'] }}"
        "{% for call in m.tool_calls or [] %} -> {{ call.function.name }}{% endfor %}|{% endfor %}assistant:"))
    messages = [{"role": "user", "content": "What is the weather?", "name": "Ada"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "content": "Sunny", "tool_call_id": "c1"}]
    reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    text = "user Ada: What is the weather?|assistant:  -> weather|tool [c1]: Sunny|assistant:"
    assert reply.usage.prompt_tokens == len(tokenizer(text)["input_ids"])


def test_finish_reason_is_stop_when_the_last_token_allowed_is_eos(server, default_model, monkeypatch):
    """The request ends on EOS exactly at max_tokens: "stop"; one token fewer cuts it: "length"."""
    url, _ = server
    model, tokenizer = default_model
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = reference_greedy(model, ids, 20)[0, ids.shape[1]:].tolist()
    at = next(i for i in range(2, len(generated)) if generated[i] not in generated[:i])
    monkeypatch.setattr(model.generation_config, "eos_token_id", generated[at])  # its first greedy occurrence

    def finish(max_tokens: int) -> tuple[str, int]:
        reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].finish_reason, reply.usage.completion_tokens

    assert finish(at + 1) == ("stop", at + 1)
    assert finish(at) == ("length", at)


def test_an_engine_failure_is_a_server_error_and_the_server_keeps_serving(server, monkeypatch):
    url, app = server
    engine = app.state.engine_loop.engine

    def out_of_memory():
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(engine, "step", out_of_memory)
    with pytest.raises(openai.InternalServerError, match="out of memory") as failed:
        client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    assert failed.value.body["type"] == "server_error"
    chunks = []
    with pytest.raises(openai.APIError, match="out of memory"):  # an error event, never a normal finish
        for chunk in client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True):
            chunks.append(chunk)
    assert all(c.choices[0].finish_reason is None for c in chunks)
    monkeypatch.undo()
    assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})
    reply = client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2


def test_requests_are_queued_and_answered_while_a_step_is_in_progress(server, monkeypatch):
    """The engine's thread takes new requests between steps: while a step runs (held here), a request that
    arrives waits for it without holding up the server's event loop (the health check answers meanwhile), and
    is decoded afterwards."""
    url, app = server
    engine = app.state.engine_loop.engine
    stepping, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        stepping.set()
        release.wait(60)
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(lambda: client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                                        temperature=0))
        assert stepping.wait(60)  # a step is in progress
        second = pool.submit(lambda: client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                                                         temperature=0))
        time.sleep(0.5)  # the second request has reached the server
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:  # answered while the step is held
            assert response.status == 200
        assert not first.done() and not second.done()
        monkeypatch.undo()
        release.set()
        assert first.result(timeout=120).usage.completion_tokens == 2
        assert second.result(timeout=120).usage.completion_tokens == 3


def test_a_failed_step_fails_its_requests_not_those_waiting_for_a_slot(default_model, monkeypatch):
    """One slot, two requests: the step that fails (its forward) ends the request in it with a server error;
    the one waiting for the slot is decoded after it, as `generate` decodes it."""
    model, tokenizer = default_model
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=4, max_length=256, api_keys=KEYS)
    with serve_in_thread(app) as url:
        loop = app.state.engine_loop
        forward, calls = loop.engine.runner.step_logits, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the first request's first decoding step: until the second has arrived
                deadline = time.monotonic() + 60
                while not loop._added and time.monotonic() < deadline:
                    time.sleep(0.01)
            if len(calls) == 3:  # the next one, the second request waiting for the slot
                assert loop.engine.waiting() == 1
                raise RuntimeError("out of memory (simulated)")
            return forward(*args, **kwargs)

        monkeypatch.setattr(loop.engine.runner, "step_logits", failing)  # every forward of the engine's
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(lambda: client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                                                            temperature=0))
            while not calls:
                time.sleep(0.01)
            second = pool.submit(lambda: client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                                                             temperature=0))
            with pytest.raises(openai.InternalServerError, match="out of memory"):
                first.result(timeout=120)
            assert second.result(timeout=120).choices[0].message.content == greedy_text(default_model, "hi", 4)


def test_an_engine_thread_that_dies_answers_every_request_and_fails_health(default_model, monkeypatch):
    """An error outside any step (here in the engine's between-step work) ends the engine's thread: the stream
    it was decoding and a request waiting for a slot get a 503 instead of waiting forever, as do later
    requests, and the health check says so."""
    model, tokenizer = default_model
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=4, max_length=256, api_keys=KEYS)
    with serve_in_thread(app) as url:
        loop = app.state.engine_loop
        step, waiting = loop.engine.step, threading.Event()
        poem = [{"role": "user", "content": "Write a long poem about the sea."}]

        def step_until_one_waits():
            if loop.engine.waiting():
                waiting.set()
            return step()

        def broken():
            if waiting.is_set():
                raise RuntimeError("a bug between steps (simulated)")
            return True

        monkeypatch.setattr(loop.engine, "step", step_until_one_waits)
        monkeypatch.setattr(loop.engine, "has_unfinished", broken)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(lambda: list(client(url).chat.completions.create(
                model=MODEL, messages=poem, max_tokens=200, temperature=0, stream=True)))
            while not loop.engine.running():
                time.sleep(0.01)
            second = pool.submit(lambda: client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=4))
            with pytest.raises(openai.APIError, match="engine has stopped"):
                first.result(timeout=120)
            with pytest.raises(openai.InternalServerError, match="engine has stopped") as refused:
                second.result(timeout=120)
            assert refused.value.status_code == 503
        with pytest.raises(openai.InternalServerError, match="engine has stopped"):
            client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        assert raw(f"{url}/health") == (503, {"status": "engine stopped"})


def test_the_bearer_scheme_is_case_insensitive_and_blank_keys_are_refused(server, default_model):
    url, _ = server
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["data"][0]["id"] == MODEL
    assert raw(f"{url}/v1/models", key="")[0] == 401
    model, tokenizer = default_model
    for key in ("", " key-a", "key a"):  # "" would let requests without a key in
        with pytest.raises(ValueError, match="an API key must be a non-empty string without spaces"):
            create_app(model, tokenizer, api_keys=("key-b", key))
    with pytest.raises(ValueError, match=r"max_megabytes must be a number in \(0, 2\*\*40\], got -1"):
        create_app(model, tokenizer, corpus_megabytes=-1)  # refused at once, not at the first request
    for origin in ("http://localhost:3000/", "localhost:3000", "http://localhost:3000/app"):  # would never match
        with pytest.raises(ValueError, match="an allowed origin must be"):
            create_app(model, tokenizer, allow_origins=(origin,))


def test_a_server_without_a_corpus_decodes_as_with_one(default_model):
    model, tokenizer = default_model
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=4, max_length=256,
                     corpus_megabytes=0)
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(reference_greedy(model, ids, 12)[0, ids.shape[1]:], skip_special_tokens=True)
    with serve_in_thread(app) as url:
        for _ in range(2):  # the second would draft from the first's reply, had it a corpus
            reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
            assert reply.choices[0].text == expected
    assert app.state.corpora == {}


def test_a_slot_freed_while_a_step_runs_is_free_for_a_request_that_arrived_meanwhile(default_model, monkeypatch):
    """One slot, no queue: while a step runs (held here), the client holding the slot leaves and another
    request arrives; between steps the engine frees the slot first, so the newcomer is decoded, not refused
    with a 429."""
    model, tokenizer = default_model
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=0, max_length=512, api_keys=KEYS)
    with serve_in_thread(app) as url:
        loop = app.state.engine_loop
        step, holding, stepping, release = loop.engine.step, threading.Event(), threading.Event(), threading.Event()

        def held_step():
            if holding.is_set():
                stepping.set()
                release.wait(60)
            return step()

        monkeypatch.setattr(loop.engine, "step", held_step)
        stream = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell a very long story."}], max_tokens=400,
            stream=True)
        chunks = iter(stream)
        while not next(chunks).choices[0].delta.content:
            pass
        holding.set()
        assert stepping.wait(60)  # a step of the first request is in progress
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream.close()
            loop.abort(loop.engine.running_ids()[0])  # its disconnect, as the server notices it
            second = pool.submit(lambda: client(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                                             temperature=0))
            deadline = time.monotonic() + 60
            while not loop._added and time.monotonic() < deadline:
                time.sleep(0.01)
            holding.clear()
            release.set()
            assert second.result(timeout=120).usage.completion_tokens == 2


def test_a_wrong_api_key_is_refused_before_the_body_is_read(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        client(url, key="not-a-key").models.list()
    code, reply = raw(f"{url}/v1/chat/completions", {"model": MODEL}, key="not-a-key")  # no messages
    assert code == 401 and reply["error"]["code"] == "invalid_api_key"  # OpenAI's code
    assert reply["error"]["message"].startswith("invalid API key: ")
    try:  # no key at all: said so
        urllib.request.urlopen(f"{url}/v1/models", timeout=60)
    except urllib.error.HTTPError as error:
        assert error.code == 401 and json.loads(error.read())["error"]["message"].startswith("no API key (no Authorization")
    else:
        pytest.fail("a request without a key was answered")
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_a_model_is_retrieved_by_its_id(server):
    url, _ = server
    assert client(url).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client(url).models.retrieve("gpt-9")


def test_the_openapi_document_describes_both_request_bodies(server):
    url, _ = server
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=60) as response:
        document = json.loads(response.read())
    schemas = document["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        return schemas[schema["$ref"].removeprefix("#/components/schemas/")] if "$ref" in schema else schema

    def refs(node) -> list[str]:
        if isinstance(node, dict):
            return ([node["$ref"]] if "$ref" in node else []) + [r for value in node.values() for r in refs(value)]
        return [r for value in node for r in refs(value)] if isinstance(node, list) else []

    bodies = {path: resolve(document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])
              for path in ("/v1/chat/completions", "/v1/completions")}
    chat, text = bodies["/v1/chat/completions"], bodies["/v1/completions"]
    assert sorted(chat["required"]) == ["messages", "model"] and sorted(text["required"]) == ["model", "prompt"]
    assert resolve(chat["properties"]["messages"]["items"])["required"] == ["role"]
    for body in bodies.values():
        assert {"max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                "lookahead"} <= set(body["properties"])
    assert "max_completion_tokens" in chat["properties"] and "max_completion_tokens" not in text["properties"]
    assert all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs(document))


def test_seeded_sampling_repeats_and_differs_by_seed(server):
    url, _ = server
    messages = [{"role": "user", "content": "Say something surprising."}]

    def sample(seed: int, lookahead="auto") -> str:
        return client(url).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0.9, seed=seed,
            extra_body={"lookahead": lookahead}).choices[0].message.content

    first = sample(1)
    assert sample(1, "off") == first  # the same tokens with lookahead off
    assert {sample(s) for s in (2, 3, 4)} != {first}


def _settled(app) -> None:
    """Wait until the engine has ended every request (a stop string's end is handed to it after the reply)."""
    loop, deadline = app.state.engine_loop, time.monotonic() + 30
    while (loop._ended or loop.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_corpus_is_kept_per_api_key(server):
    """A request's prompt and reply, and the model's predictions while decoding it (the recycle source's
    table), join its own key's corpus only: another key's requests never draft from them."""
    url, app = server
    corpora = app.state.corpora
    _settled(app)
    before = {key: (len(corpora[key]), len(corpora[key].successors)) if key in corpora else (0, 0) for key in KEYS}
    question = {"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}
    client(url, KEYS[0]).chat.completions.create(model=MODEL, messages=[question], max_tokens=8, temperature=0)
    assert len(corpora[KEYS[0]]) == before[KEYS[0]][0] + 1
    assert len(corpora[KEYS[0]].successors) > 0
    other = corpora.get(KEYS[1])
    assert ((len(other), len(other.successors)) if other is not None else (0, 0)) == before[KEYS[1]]


@pytest.mark.parametrize("past_cut", [1, 8])
def test_a_reply_cut_by_a_stop_string_joins_the_corpus_up_to_the_cut(server, default_model, past_cut):
    """A stop string ends a request as its last token would: its text so far joins its key's corpus (the
    tokens the engine decoded past the cut do not), also where max_tokens ends the request a token past the
    cut (past_cut 1), a step later or in the same step, before the reply's reader has seen the cut."""
    url, app = server
    model, tokenizer = default_model
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = reference_greedy(model, ids, 20)[0, ids.shape[1]:].tolist()
    stop = tokenizer.decode(generated, skip_special_tokens=True).strip()[3:6]
    through = next(n for n in range(1, 21) if stop in tokenizer.decode(generated[:n], skip_special_tokens=True))
    _settled(app)
    corpus = app.state.corpora.get(KEYS[0])
    documents = len(corpus) if corpus is not None else 0
    cut = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=through + past_cut, temperature=0,
                                         stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == through
    _settled(app)
    corpus = app.state.corpora[KEYS[0]]
    assert len(corpus) == documents + 1
    assert list(corpus._documents[-1]) == ids[0].tolist() + generated[:through]


def test_the_serve_command_starts_on_the_default_model():
    """`lookahead serve` with no model: it says where it listens (the port the system chose for --port 0), serves,
    and on Ctrl-C ends the replies in progress at once (an error event ends a stream) rather than waiting for
    them to reach max_tokens."""
    import re
    import shutil
    import signal
    import subprocess
    import sys
    from pathlib import Path

    command = shutil.which("lookahead", path=str(Path(sys.executable).parent))
    # One thread, as each test worker runs: the server reads the cost curves the workers measured instead of
    # measuring its own on two threads beside them (103 s to answer in a fresh CI run). Where it runs before
    # the workers have measured them, it says so first ("lookahead: timing ..."), then where it serves.
    process = subprocess.Popen([command, "serve", "--port", "0", "--max-batch", "2", "--threads", "1",
                                "--corpus-mb", "8", "--allow-origin", "http://localhost:3000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said: list[str] = []

        def until_serving() -> None:
            for line in process.stderr:
                said.append(line)
                if line.startswith("serving "):
                    return

        reader = threading.Thread(target=until_serving, daemon=True)
        reader.start()
        reader.join(240)
        assert said and said[-1].startswith("serving "), f"the server did not say where it serves in 240 s: {said}"
        url = re.fullmatch(r"serving SmolLM2-135M-Instruct on (http://127\.0\.0\.1:\d+) \(.*\)\n", said[-1]).group(1)
        assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = api.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=4,
                                       temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].text
        assert preflight(url, "http://localhost:3000") == (200, "http://localhost:3000")
        code, error = raw(f"{url}/health", headers={"Host": "attacker.example"})
        assert code == 400 and "--allow-host" in error["error"]["message"]
        stream = api.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=1500,
                                        stream=True, logit_bias={"2": -100})  # no end of text: 1,500 tokens
        chunks = iter(stream)
        next(chunks)
        process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="engine has stopped"):
            for _ in chunks:
                pass
        assert process.wait(timeout=30) == 130  # as Ctrl-C ends a program
        assert "stopping: replies in progress end now" in process.stderr.read()
    finally:
        process.terminate()
        process.wait(timeout=30)

def test_a_full_queue_answers_429_and_the_server_keeps_serving(default_model):
    model, tokenizer = default_model
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=0, max_length=1024)
    with serve_in_thread(app) as url:
        messages = [{"role": "user", "content": "Tell a very long story."}]
        busy = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=900, stream=True)
        chunks = iter(busy)
        while not next(chunks).choices[0].delta.content:
            pass
        with pytest.raises(openai.RateLimitError, match="server is full"):  # one slot, no room to wait
            client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        busy.close()
        deadline = time.time() + 20
        while app.state.engine_loop.engine.running() and time.time() < deadline:
            time.sleep(0.1)
        reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics, sample by sample."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_metrics_count_requests_tokens_and_latencies(server):
    url, _ = server
    before = scrape(url)
    off = {"lookahead": "off"}  # a token a step: every token but the first has its own interval
    reply = client(url).completions.create(model=MODEL, prompt="One, two, three,", max_tokens=10, temperature=0,
                                           extra_body=off)
    assert raw(f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2})[0] == 400
    assert raw(f"{url}/v1/models", key="wrong")[0] == 401
    after = scrape(url)
    made = reply.usage.completion_tokens

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew('lookahead_requests_total{endpoint="completions"}') == 1
    assert grew("lookahead_generated_tokens_total") == made
    assert grew("lookahead_prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("lookahead_time_to_first_token_seconds_count") == 1
    assert grew("lookahead_inter_token_latency_seconds_count") == made - 1
    assert grew("lookahead_tokens_per_step_count") == 1 and grew("lookahead_tokens_per_step_sum") >= 1
    assert after["lookahead_queue_depth"] == 0 and after["lookahead_running"] == 0
    assert grew('lookahead_error_responses_total{status="400"}') == 1
    assert grew('lookahead_error_responses_total{status="401"}') == 1
    # A reply cut by a stop string counts the tokens sent, not the engine's past the cut, and finishes; a request
    # of two prompts is one request.
    before = after
    cut = client(url).completions.create(model=MODEL, prompt="One, two, three,", max_tokens=10, temperature=0,
                                         stop=[reply.choices[0].text.split(",")[1]], extra_body=off)
    both = client(url).completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0,
                                          extra_body=off)
    after = scrape(url)
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < made
    assert grew('lookahead_requests_total{endpoint="completions"}') == 2
    assert grew("lookahead_generated_tokens_total") == cut.usage.completion_tokens + both.usage.completion_tokens
    first_tokens = 3  # of the three prompts: no interval before them
    assert grew("lookahead_inter_token_latency_seconds_count") == (
        cut.usage.completion_tokens + both.usage.completion_tokens - first_tokens)
    assert grew("lookahead_tokens_per_step_count") == 3


def test_tokens_that_come_with_the_first_count_in_no_inter_token_interval(server):
    url, _ = server
    # A pattern that the reply's first step continues from the prompt: several tokens at once.
    before = scrape(url)
    events = []
    with client(url).completions.create(model=MODEL, prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=12,
                                        temperature=0, stream=True, stream_options={"include_usage": True}) as stream:
        for event in stream:
            events.append(event)
    after = scrape(url)
    progress = [e.model_extra["lookahead"]["tokens"] for e in events if (e.model_extra or {}).get("lookahead")]
    first, made = progress[0], events[-1].usage.completion_tokens
    assert first > 1 and progress[-1] == made  # the case tested; the last event says the whole count
    assert after["lookahead_inter_token_latency_seconds_count"] - before["lookahead_inter_token_latency_seconds_count"] \
        == made - first


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_bench_serve_counts_a_last_step_that_makes_no_text(server, mode):
    url, _ = server
    # A short reply ending in the end-of-sequence token, which makes no text: with lookahead off it comes in a step
    # of its own, which sends no text; the bench counted it in neither tokens nor steps.
    result = stream_chat(url, MODEL, "What is 2+2?", 64, mode, KEYS[0], timeout=120)
    reply = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                                max_tokens=64, temperature=0, extra_body={"lookahead": mode})
    assert result.error is None and reply.choices[0].finish_reason == "stop"
    assert result.tokens == reply.usage.completion_tokens and result.text == reply.choices[0].message.content
    if mode == "off":
        assert result.steps == result.tokens and len(result.gaps) == result.tokens - 1


def chromium_driver(tmp_path):
    """Debian's headless Chromium through selenium (scripts/setup.sh installs both where it can)."""
    import os
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        if os.environ.get("LOOKAHEAD_NO_BROWSER") == "1":
            pytest.skip("LOOKAHEAD_NO_BROWSER=1 and no chromium/chromedriver on PATH")
        pytest.fail("the page test needs chromium and chromedriver (Debian: apt-get install chromium "
                    "chromium-driver); set LOOKAHEAD_NO_BROWSER=1 to skip it")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_the_page_streams_a_reply_with_live_speed_in_a_real_browser(server, default_model, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    url, _ = server
    question = "Name three colours of the rainbow."
    browser = chromium_driver(tmp_path)
    try:
        browser.get(f"{url}/")
        wait = WebDriverWait(browser, 60)
        text = lambda element_id: browser.find_element(By.ID, element_id).get_attribute("textContent")  # noqa: E731
        wait.until(lambda _: "API key" in text("model"))  # the server wants a key: the page says so
        key = browser.find_element(By.ID, "key")
        key.send_keys(KEYS[0])
        key.send_keys(Keys.TAB)  # the change event: the page asks for the models again, with the key
        wait.until(lambda _: text("model") == MODEL)
        # Every value the token counter shows while the reply streams, and the state beside it at the time.
        browser.execute_script("""
            window.seen = [];
            new MutationObserver(() => window.seen.push([document.getElementById('tokens').textContent,
                                                         document.getElementById('state').textContent]))
              .observe(document.getElementById('tokens'), {childList: true, characterData: true, subtree: true});
        """)
        browser.find_element(By.ID, "prompt").send_keys(question, Keys.ENTER)
        wait.until(lambda _: text("state") in ("done", "failed"))
        assert text("state") == "done"
        replies = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")
        expected = greedy_text(default_model, question, 256)
        assert [r.get_attribute("textContent") for r in replies] == [expected]
        seen = browser.execute_script("return window.seen")
        assert len({tokens for tokens, _ in seen}) > 1 and {state for _, state in seen} == {"generating"}
        tokens, rate, per_step = int(text("tokens")), float(text("rate")), float(text("per-step"))
        assert tokens == int(seen[-1][0]) and rate > 0 and 1.0 <= per_step <= tokens
    finally:
        browser.quit()


def _expected_logprobs(default_model, ids: torch.Tensor, tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `ids` and the model's log-probabilities at each ([tokens, vocab])."""
    model, _ = default_model
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=tokens, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def test_chat_logprobs_are_the_models_streamed_or_not(server, default_model):
    """Each token's log-probability and its 3 likeliest alternatives, as the model gives them (greedy: the
    token is the likeliest); the tokens' bytes make up the reply; a stream carries the same entries."""
    url, _ = server
    _, tokenizer = default_model
    question = {"role": "user", "content": "Name the largest planet of the solar system."}
    tokens, expected = _expected_logprobs(default_model, encode_messages(tokenizer, [question]), 12)
    reply = client(url).chat.completions.create(model=MODEL, messages=[question], max_tokens=12, temperature=0,
                                                logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == len(tokens) == reply.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode() == reply.choices[0].message.content
    for entry, token, row in zip(entries, tokens, expected):
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [tokenizer.convert_tokens_to_string(
            tokenizer.convert_ids_to_tokens([t])).encode() for t in row.topk(3).indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-3)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the likeliest token
    chunks = client(url).chat.completions.create(model=MODEL, messages=[question], max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    # the second reply drafts from the first one (the corpus): steps of other heights, other float rounding
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)


@pytest.mark.parametrize("name", ["<|im_start|>", "<file_sep>"])  # named special, and only added as special
def test_a_special_token_in_the_reply_moves_no_text_offset(server, default_model, name):
    """The reply's text leaves special tokens out; its offsets counted each one's text (12 characters for
    "<|im_start|>"), so every later offset pointed past the text."""
    url, _ = server
    _, tokenizer = default_model
    special = tokenizer.convert_tokens_to_ids(name)
    reply = client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=0,
                                           logit_bias={str(special): 100})
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [name] * 4 and reply.choices[0].text == ""
    assert logprobs.text_offset == [0, 0, 0, 0]


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_vanishing_temperature_decodes_greedily(server, temperature):
    """Logits divided by it overflowed to infinities, and the reply was special tokens drawn from the noise."""
    url, _ = server
    options = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "seed": 3}
    greedy = client(url).completions.create(**options, temperature=0).choices[0]
    tiny = client(url).completions.create(**options, temperature=temperature).choices[0]
    assert (tiny.text, tiny.finish_reason) == (greedy.text, greedy.finish_reason) and greedy.text.strip()


def _tops_hold_the_chosen_token(logprobs, top: int) -> bool:
    """A completion's top_logprobs: at each position the `top` likeliest tokens and the chosen one (OpenAI: "up to
    logprobs+1 elements"), which had been left out (the first of an echoed prompt has none)."""
    for token, chosen, scored in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        if scored is None:
            if chosen is not None:
                return False
            continue
        if scored.get(token) != chosen:
            return False
        if len(scored) == top + 1:  # the chosen token beside the likeliest ones: below them all
            if any(value < chosen for name, value in scored.items() if name != token):
                return False
        elif len(scored) != top or top == 0:
            return False
    return True


def test_completion_logprobs_in_the_legacy_format(server, default_model):
    url, _ = server
    _, tokenizer = default_model
    prompt = "The three primary colours are"
    tokens, expected = _expected_logprobs(default_model, tokenizer(prompt, return_tensors="pt")["input_ids"], 8)
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(tokens))]
    assert logprobs.token_logprobs == pytest.approx([row[t].item() for t, row in zip(tokens, expected)], abs=1e-3)
    assert all(len(top) == 2 and max(top.values()) == chosen
               for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert _tops_hold_the_chosen_token(logprobs, 2)
    bare = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    assert bare.choices[0].logprobs.top_logprobs == [{t: p} for t, p in zip(bare.choices[0].logprobs.tokens,
                                                                            bare.choices[0].logprobs.token_logprobs)]
    assert bare.choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs, abs=1e-4)
    stop = "".join(logprobs.tokens[4:6])  # completed by the sixth token: the reply counts six, its text four
    cut = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                         stop=[stop])
    assert cut.choices[0].text == "".join(logprobs.tokens[:4]) and cut.usage.completion_tokens == 6
    assert cut.choices[0].logprobs.tokens == logprobs.tokens[:6]


def test_token_bytes_add_up_to_the_text_where_tokens_split_characters(default_model):
    """Byte-level pieces (the default tokenizer) and SentencePiece pieces with byte fallback: a token holding
    part of a character has those bytes alone, and the tokens' bytes add up to the text's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lookahead.serve import decodes_byte_level, token_bytes

    _, tokenizer = default_model
    text = "Caf\u00e9 \U0001F600 na\u00efve \u4e16\u754c"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert decodes_byte_level(tokenizer) and len(ids) > len(text.split())
    assert b"".join(token_bytes(tokenizer, t, True) for t in ids) == text.encode()

    vocab = [("<unk>", 0.0), ("\u2581a", -1.0), ("\u2581", -2.0)] + [(f"<0x{b:02X}>", -5.0) for b in range(256)]
    pieces = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    pieces.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    pieces.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581", prepend_scheme="always"),
                                        decoders.ByteFallback(), decoders.Fuse()])
    fallback = PreTrainedTokenizerFast(tokenizer_object=pieces, unk_token="<unk>")
    ids = fallback.encode("a \u00e9 a", add_special_tokens=False)
    assert fallback.convert_ids_to_tokens(ids)[2:4] == ["<0xC3>", "<0xA9>"]  # the character split in two
    assert not decodes_byte_level(fallback)
    assert b"".join(token_bytes(fallback, t, False) for t in ids) == " a \u00e9 a".encode()


class _ReferencePenalties:
    """OpenAI's frequency and presence penalties and logit bias, written out token by token."""

    def __init__(self, prompt_length: int, frequency: float, presence: float, bias: dict[int, float]) -> None:
        self.prompt_length, self.frequency, self.presence, self.bias = prompt_length, frequency, presence, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from collections import Counter

        scores = scores.clone()
        for token, count in Counter(input_ids[0, self.prompt_length :].tolist()).items():
            scores[0, token] -= self.frequency * count + self.presence
        for token, bias in self.bias.items():
            scores[0, token] += bias
        return scores


def test_frequency_and_presence_penalties_and_logit_bias_apply_as_openai_defines_them(server, default_model):
    url, _ = server
    model, tokenizer = default_model
    question = {"role": "user", "content": "List the days of the week, twice."}
    ids = encode_messages(tokenizer, [question])
    plain = reference_greedy(model, ids, 40)[0, ids.shape[1]:].tolist()
    banned = plain[2]  # a token the plain reply has early on
    options = {"frequency_penalty": 0.8, "presence_penalty": 0.6, "logit_bias": {str(banned): -100}}
    reference = _ReferencePenalties(ids.shape[1], 0.8, 0.6, {banned: -100.0})
    with torch.inference_mode():
        expected = model.generate(ids, do_sample=False, max_new_tokens=40, logits_processor=[reference])
    expected_text = tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected[0, ids.shape[1]:].tolist() != plain and banned not in expected[0, ids.shape[1]:].tolist()
    reply = client(url).chat.completions.create(model=MODEL, messages=[question], max_tokens=40, temperature=0,
                                                **options)
    assert reply.choices[0].message.content == expected_text
    code, body = raw(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [question], "max_tokens": 40,
                                                    "temperature": 0, "lookahead": "off", **options})
    assert code == 200 and body["choices"][0]["message"]["content"] == expected_text


def test_openai_penalties_match_their_definition_on_random_replies():
    from lookahead.serve import OpenAIPenalties

    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        prompt = int(torch.randint(1, 6, (1,), generator=generator))
        length = prompt + int(torch.randint(0, 20, (1,), generator=generator))
        ids = torch.randint(0, 12, (1, length), generator=generator)
        scores = torch.randn(1, 12, generator=generator)
        frequency, presence = torch.rand(2, generator=generator).mul(4).sub(2).tolist()
        bias = {int(t): float(b) for t, b in zip(torch.randint(0, 12, (3,), generator=generator),
                                                 torch.randn(3, generator=generator) * 50)}
        expected = _ReferencePenalties(prompt, frequency, presence, bias)(ids, scores)
        torch.testing.assert_close(OpenAIPenalties(prompt, frequency, presence, bias)(ids, scores), expected)


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(server, default_model):
    """`echo` with `max_tokens: 0` and `logprobs` (how lm-evaluation-harness scores a text over the completions
    API): the prompt's tokens with the model's log-probability of each after the ones before it (the first
    has none); with tokens to generate, the reply follows the prompt, in the text and in the logprobs."""
    url, _ = server
    model, tokenizer = default_model
    prompt = "The capital of France is Paris"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    scored = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            temperature=0)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert "".join(logprobs.tokens) == prompt and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and _tops_hold_the_chosen_token(logprobs, 1)
    assert any(len(top) == 2 for top in logprobs.top_logprobs[1:])  # a prompt token the model did not expect
    assert logprobs.token_logprobs[1:] == pytest.approx(
        expected[torch.arange(ids.shape[1] - 1), ids[0, 1:]].tolist(), abs=1e-4)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(ids.shape[1])]

    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, logprobs=0,
                                           temperature=0)
    alone = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=0, temperature=0)
    assert reply.choices[0].text == prompt + alone.choices[0].text
    assert reply.choices[0].logprobs.tokens == logprobs.tokens + alone.choices[0].logprobs.tokens
    streamed = list(client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


def test_a_completion_of_several_prompts_or_of_token_ids_has_a_choice_for_each(server, default_model):
    """`prompt` as a list of strings, token ids or lists of token ids (what lm-evaluation-harness and
    OpenAI's client send): a choice per prompt, in order, each its prompt's greedy reply; usage summed."""
    url, _ = server
    _, tokenizer = default_model
    texts = ["The capital of France is", "def add(a, b):"]
    alone = [client(url).completions.create(model=MODEL, prompt=t, max_tokens=6, temperature=0) for t in texts]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    for prompt in (texts, ids):
        reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert [c.index for c in reply.choices] == [0, 1]
        assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone]
        assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
        assert reply.usage.prompt_tokens == sum(map(len, ids))
    one = client(url).completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0, echo=True)
    assert one.choices[0].text == texts[0] + alone[0].choices[0].text
    for body, words in (({"prompt": [texts[0], "x" * 8000]}, "max_length of 1024"),
                        ({"prompt": [[5, 10**6]]}, "prompt token ids must be in [0, 49152), got 1000000"),
                        ({"prompt": []}, "prompt must not be empty"),
                        ({"prompt": texts, "stream": True}, "a streamed completion takes one prompt"),
                        ({"prompt": [1, "a"]}, "a string, a list of strings, a list of token ids")):
        code, error = raw(f"{url}/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
        assert code == 400 and words in error["error"]["message"] and error["error"]["param"] == "prompt", body
    assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})


def test_a_completion_of_more_prompts_than_the_server_holds_is_a_400(server, monkeypatch):
    """More prompts than max_batch + max_queue (4 + 40) could never get in together: a 429 ("retry later")
    would fail again however long the client waited. They are counted before any is tokenized (a list of a
    million prompts had been tokenized first)."""
    url, app = server
    with monkeypatch.context() as patch:
        patch.setattr(CompletionRequest, "prompts", lambda *_: pytest.fail("tokenized before being counted"))
        code, error = raw(f"{url}/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 45, "max_tokens": 50})
    assert code == 400 and error["error"]["param"] == "prompt" and "at most 44 in one request" in error["error"]["message"]
    assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})
    reply = client(url).completions.create(model=MODEL, prompt=["Hi"] * 44, max_tokens=1)
    assert len(reply.choices) == 44


def test_prompt_scoring_waits_its_turn_and_a_full_server_says_when_to_retry(default_model, monkeypatch):
    """Echoed prompts are scored one at a time (the logits of a 4096-token prompt take 800 MB), as many in all as
    the engine holds (max_batch + max_queue) even with nothing to generate: beyond, a request gets 429 with
    Retry-After, before any forward of its own (it had scored every prompt at once, whatever the queue). The
    prompts of one request never turn each other away."""
    import lookahead.serve

    model, tokenizer = default_model
    scoring, release, scored = threading.Event(), threading.Event(), []
    score = lookahead.serve._PromptScorer._logits

    def held(scorer, prompt):
        scored.append(prompt.numel())
        scoring.set()
        release.wait(timeout=60)
        return score(scorer, prompt)

    monkeypatch.setattr(lookahead.serve._PromptScorer, "_logits", held)
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=2, max_queue=1, max_length=256)
    body = {"model": MODEL, "prompt": "Roses are red", "max_tokens": 0, "echo": True, "logprobs": 1}
    with serve_in_thread(app) as url, concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(raw, f"{url}/v1/completions", body)
        assert scoring.wait(timeout=30)
        waiting = [pool.submit(raw, f"{url}/v1/completions", body) for _ in range(2)]
        deadline = time.time() + 30
        while app.state.prompt_scorer.waiting < 2 and time.time() < deadline:
            time.sleep(0.05)
        request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
        assert json.loads(refused.value.read())["error"]["code"] == "rate_limit_exceeded"
        release.set()
        replies = [first.result(), *(w.result() for w in waiting)]
        assert [code for code, _ in replies] == [200] * 3
        assert replies[0][1]["choices"] == replies[1][1]["choices"] == replies[2][1]["choices"]
        assert scored == [4, 4, 4]  # the refused request ran no forward
        code, three = raw(f"{url}/v1/completions", {**body, "prompt": ["Roses are red"] * 3})
        assert code == 200 and [c["logprobs"] for c in three["choices"]] == [replies[0][1]["choices"][0]["logprobs"]] * 3


def test_log_probabilities_that_fail_fail_their_request_alone(default_model, monkeypatch):
    """They are computed on the engine's thread: one failing (out of memory, say) had ended that thread, and with it
    every request after (503)."""
    import lookahead.serve

    model, tokenizer = default_model
    of, calls = lookahead.serve._TokenLogprobs.of, []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return of(*args)

    monkeypatch.setattr(lookahead.serve._TokenLogprobs, "of", staticmethod(failing_once))
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=1, max_length=256)
    body = {"model": MODEL, "prompt": "Roses are red", "max_tokens": 3, "logprobs": 2, "temperature": 0}
    with serve_in_thread(app) as url:
        code, failed = raw(f"{url}/v1/completions", body)
        assert code == 500 and "out of memory (simulated)" in failed["error"]["message"]
        code, reply = raw(f"{url}/v1/completions", body)
        assert code == 200 and len(reply["choices"][0]["logprobs"]["tokens"]) == 3
        assert app.state.engine_loop.alive()


def test_a_client_that_leaves_while_its_echoed_prompt_waits_to_be_scored_frees_its_slot(default_model, monkeypatch):
    """Its reply decodes while its prompt waits its turn to be scored: the client leaving then freed its slot only
    once that prompt had been scored (behind others, seconds later; here never, the scoring held)."""
    import lookahead.serve

    model, tokenizer = default_model
    scoring, release = threading.Event(), threading.Event()
    score = lookahead.serve._PromptScorer._logits

    def held(scorer, prompt):
        scoring.set()
        release.wait(timeout=60)
        return score(scorer, prompt)

    monkeypatch.setattr(lookahead.serve._PromptScorer, "_logits", held)
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)  # it would decode all 900 tokens
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=1, max_length=1024)
    engine = app.state.engine_loop.engine
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "echo": True,
                       "logprobs": 1}).encode()
    try:
        with serve_in_thread(app) as url:
            address = urlsplit(url)
            with socket.create_connection((address.hostname, address.port)) as connection:
                connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                   b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                assert scoring.wait(timeout=30)
                assert engine.running() == 1
            deadline = time.time() + 20
            while engine.running() and time.time() < deadline:
                time.sleep(0.05)
            assert engine.running() == 0 and not release.is_set()  # freed while its prompt was still being scored
            release.set()
    finally:
        release.set()


def test_requests_waiting_for_the_tokenizer_are_bounded_by_the_queue(default_model, monkeypatch):
    """As many requests as the engine takes (max_batch + max_queue) may wait for the one tokenizer thread; more get
    429, as they would once tokenized. They had waited unbounded (40 long prompts held a short request 15 s)."""
    from lookahead.serve import CompletionRequest

    model, tokenizer = default_model
    release = threading.Event()
    prompts = CompletionRequest.prompts

    def slow(body, *args):
        release.wait(timeout=60)
        return prompts(body, *args)

    monkeypatch.setattr(CompletionRequest, "prompts", slow)
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_queue=1, max_length=256)
    body = {"model": MODEL, "prompt": "Roses are red", "max_tokens": 2, "temperature": 0}
    try:
        with serve_in_thread(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(raw, f"{url}/v1/completions", body) for _ in range(2)]
            deadline = time.time() + 30
            while scrape(url)["lookahead_tokenizing"] < 2 and time.time() < deadline:
                time.sleep(0.05)
            assert scrape(url)["lookahead_tokenizing"] == 2
            code, refused = raw(f"{url}/v1/completions", body)
            assert code == 429 and refused["error"]["code"] == "rate_limit_exceeded"
            release.set()
            assert [future.result()[0] for future in held] == [200, 200]
            assert scrape(url)["lookahead_tokenizing"] == 0
    finally:
        release.set()


def test_logprobs_of_tokens_that_split_a_character(server, default_model):
    """An emoji is three of SmolLM2's tokens: a token holding part of a character is named by its bytes (two such
    tokens had shared the key "\ufffd" of top_logprobs, one hiding the other), and text_offset counts the
    characters before each token's (a partial token adds none)."""
    url, _ = server
    _, tokenizer = default_model
    prompt = "Party \U0001f389 time \U0001f389\U0001f389 ok"
    ids = tokenizer(prompt)["input_ids"]
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=5)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == prompt
    assert logprobs.tokens[2:5] == ["bytes: \\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89"]
    assert _tops_hold_the_chosen_token(logprobs, 5)
    expected = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert logprobs.text_offset == expected and expected[3] == expected[4] == expected[2] + 1


def test_errors_carry_openais_codes_and_unknown_routes_answer_in_its_schema(server):
    url, _ = server
    code, reply = raw(f"{url}/v1/chat/completions", {"model": "gpt-4", "messages": HI})
    assert code == 404 and reply["error"]["code"] == "model_not_found"
    code, reply = raw(f"{url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded"
    code, reply = raw(f"{url}/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert code == 404 and reply["error"] == {"message": "Not Found", "type": "invalid_request_error", "param": None,
                                              "code": None}
    code, reply = raw(f"{url}/v1/completions")  # a GET
    assert code == 405 and reply["error"]["message"] == "Method Not Allowed"


def test_without_max_tokens_a_text_completion_gets_openais_16_and_a_chat_reply_the_context(server):
    url, _ = server
    completion = client(url).completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4, 5,", temperature=0)
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"
    chat = client(url).chat.completions.create(model=MODEL, temperature=0, stream=True, messages=[
        {"role": "user", "content": "Write the numbers from 1 to 200, separated by commas."}])
    for chunk in chat:  # past the old default's cap of 256, and no finish meanwhile
        assert chunk.choices[0].finish_reason is None
        if chunk.model_extra.get("lookahead", {}).get("tokens", 0) > 256:
            break
    else:
        pytest.fail("the reply ended before its 257th token")
    chat.close()


def test_echo_scores_a_prompt_of_max_length_tokens(server):
    """Nothing to generate: the prompt need only fit (it had been refused for want of room for a token of reply);
    a token longer is refused."""
    url, app = server
    ids = [5] * app.state.engine_loop.engine.max_length
    code, reply = raw(f"{url}/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True})
    assert code == 200 and reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                              "total_tokens": len(ids)}, reply
    code, reply = raw(f"{url}/v1/completions", {"model": MODEL, "prompt": ids + [5], "max_tokens": 0, "echo": True})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "is 1025 tokens long: it exceeds the server's max_length of 1024" in reply["error"]["message"]


def test_echo_alone_and_streamed_with_logprobs(server):
    """`echo` with nothing to generate and no logprobs gives the prompt back; streamed with logprobs, the first
    chunk carries the prompt's tokens and the later ones the reply's, in order."""
    url, _ = server
    prompt = "Roses are red"
    alone = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert alone.choices[0].text == prompt and alone.choices[0].logprobs is None
    assert alone.usage.completion_tokens == 0 and alone.choices[0].finish_reason == "length"
    whole = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=1,
                                           temperature=0)
    chunks = [c for c in client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True,
                                                        logprobs=1, temperature=0, stream=True) if c.choices]
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_echo_with_logprobs_of_a_one_token_prompt(server):
    """A prompt of one token has no log-probability to give: its entry is null (an empty list of the others
    had crashed the request with a 500)."""
    url, _ = server
    for prompt in ("hi", [5]):
        reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert reply.choices[0].logprobs.token_logprobs == [None] and reply.choices[0].logprobs.top_logprobs == [None]


def test_a_fault_of_the_servers_own_is_a_500_in_openais_error_schema(server, monkeypatch):
    import lookahead.serve

    def broken(*_):
        raise RuntimeError("a bug")

    url, _ = server
    monkeypatch.setattr(lookahead.serve._Logprobs, "add_prompt", broken)
    code, reply = raw(f"{url}/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 0, "echo": True,
                                                "logprobs": 1})
    assert code == 500 and reply["error"]["type"] == "server_error" and "RuntimeError: a bug" in reply["error"]["message"]
    assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})


def test_top_k_limits_sampling_and_vllms_defaults_are_accepted(server, default_model):
    """vLLM's `top_k` (sent by Open WebUI, LiteLLM): top-k 1 samples the greedy reply whatever the seed; its
    other extensions are accepted at the values that ask for nothing."""
    url, _ = server
    question = "Name three colours of the rainbow."
    expected = greedy_text(default_model, question, 12)
    for seed in (1, 2):
        code, body = raw(f"{url}/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 12,
            "temperature": 1.0, "seed": seed, "top_k": 1, "min_p": 0, "repetition_penalty": 1, "ignore_eos": False})
        assert code == 200 and body["choices"][0]["message"]["content"] == expected
        # OpenAI's top_p 0: the likeliest token alone (it had been refused)
        reply = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                    max_tokens=12, temperature=1.0, top_p=0, seed=seed)
        assert reply.choices[0].message.content == expected


def test_a_page_of_an_allowed_origin_may_call_the_api_from_a_browser(default_model, server):
    """CORS, for web front-ends served from another origin (`--allow-origin`): the browser's preflight passes
    without an API key (it carries none), replies name the origin; other origins, and every origin on a server
    that allows none, get no such header (the browser then blocks the page's request)."""
    model, tokenizer = default_model
    page = "http://localhost:3000"
    app = create_app(model, tokenizer, model_name=MODEL, max_batch=1, max_length=64, api_keys=KEYS,
                     allow_origins=(page,))
    with serve_in_thread(app) as url:
        assert preflight(url, page) == (200, page)
        assert preflight(url, "http://elsewhere.example")[1] is None
        request = urllib.request.Request(f"{url}/v1/models", headers={"Origin": page, "Authorization": "Bearer key-a"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.headers["Access-Control-Allow-Origin"] == page and json.loads(response.read())["data"]
    assert preflight(server[0], page)[1] is None



def test_bodies_that_are_not_json_text_get_a_4xx_and_the_server_keeps_serving(server):
    """A body a browser could post to any site unasked (text/plain, a form) is 415: a page of another site cannot
    make a server on this machine generate. Past 16 MiB (declared or streamed) it is 413; JSON nested past
    Python's recursion limit or holding half a character (an unpaired surrogate escape) is 400. Each had been
    accepted or had been a 500."""
    import http.client

    url, _ = server
    chat = f"{url}/v1/chat/completions"
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        code, error = raw(chat, body, headers={"Content-Type": kind})
        assert code == 415 and "Content-Type: application/json" in error["error"]["message"], kind
    assert raw(chat, body, headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200
    deep = b'{"model": "smollm2", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    code, error = raw(chat, deep)
    assert code == 400 and "nests too deeply" in error["error"]["message"]
    for request in ({"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]},
                    {"model": MODEL, "prompt": ["fine", "\udc00"]}):
        path = "chat/completions" if "messages" in request else "completions"
        code, error = raw(f"{url}/v1/{path}", json.dumps(request).encode())  # json.dumps escapes it: \ud800
        assert code == 400 and "unpaired surrogate" in error["error"]["message"], request
    emoji = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\U0001f600?"}], "max_tokens": 1})
    assert "\\ud83d\\ude00" in emoji and raw(chat, emoji.encode())[0] == 200  # a pair of escapes is one character

    def too_large(send: Callable[[http.client.HTTPConnection], None]) -> None:
        connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
        connection.putrequest("POST", "/v1/chat/completions")
        for name, value in {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}.items():
            connection.putheader(name, value)
        send(connection)
        response = connection.getresponse()
        assert response.status == 413 and "16777216 bytes" in json.loads(response.read())["error"]["message"]
        connection.close()

    def declared(connection: http.client.HTTPConnection) -> None:  # answered before any of the body is read
        connection.putheader("Content-Length", str(2**24 + 1))
        connection.endheaders()

    def chunked(connection: http.client.HTTPConnection) -> None:  # no length said: counted as it comes
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        for chunk in [b" " * 2**20] * 16 + [body]:
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        connection.send(b"0\r\n\r\n")

    too_large(declared)
    too_large(chunked)
    assert raw(f"{url}/health") == (200, {"status": "ok", "running": 0, "waiting": 0})


def test_prompts_are_tokenized_beside_the_event_loop(server, monkeypatch):
    """While a long prompt is tokenized (or a chat template renders), the server answers other requests and
    streams other replies: the tokenizer runs on a thread of its own."""
    url, _ = server
    entered, release = threading.Event(), threading.Event()
    tokenize = ChatRequest.prompts

    def slow(self, *args):
        entered.set()
        release.wait(30)
        return tokenize(self, *args)

    monkeypatch.setattr(ChatRequest, "prompts", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(raw, f"{url}/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2})
        assert entered.wait(30)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as response:  # had waited for the tokenizer
                assert response.status == 200
        finally:
            release.set()
        assert pending.result()[0] == 200


def test_a_server_on_the_loopback_address_answers_its_loopback_names_alone(server):
    """DNS rebinding: a site's page whose name has been pointed at 127.0.0.1 addresses its requests to that
    name; the server refuses them, and answers localhost, 127.0.0.1 and [::1] on any port."""
    url, _ = server
    port = urlsplit(url).port
    before = scrape(url)
    for host in ("attacker.example", f"attacker.example:{port}", "localhost.attacker.example", ""):
        code, error = raw(f"{url}/v1/models", headers={"Host": host})
        assert code == 400 and "--allow-host" in error["error"]["message"], host
    assert scrape(url)['lookahead_error_responses_total{status="400"}'] - before.get(
        'lookahead_error_responses_total{status="400"}', 0) == 4
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert raw(f"{url}/v1/models", headers={"Host": host})[0] == 200, host
    assert hosts_to_allow("127.0.0.1") == hosts_to_allow("::1") == hosts_to_allow("localhost") == LOOPBACK_HOSTS
    assert hosts_to_allow("127.0.0.1", ["api.example.com"]) == (*LOOPBACK_HOSTS, "api.example.com")
    assert hosts_to_allow("127.0.0.1", ["*"]) == hosts_to_allow("0.0.0.0") == hosts_to_allow("myhost") == ()
    assert hosts_to_allow("0.0.0.0", ["api.example.com"]) == ("api.example.com",)


def test_the_page_sends_once_keeps_a_conversation_within_the_context_and_starts_anew(server, default_model, tmp_path):
    """Enter while a reply streams does not send the question again (the typed text waits in the box); a
    conversation grown past the server's context leaves out its oldest exchanges, saying so; New chat forgets
    it. The page runs under its Content-Security-Policy (a wrong hash would stop its script)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    url, _ = server
    question = "Name three colours of the rainbow."
    expected = greedy_text(default_model, question, 256)
    with urllib.request.urlopen(f"{url}/", timeout=10) as response:
        policy = response.headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in policy and "frame-ancestors 'none'" in policy
    browser = chromium_driver(tmp_path)
    try:
        browser.get(f"{url}/")
        wait = WebDriverWait(browser, 60)
        text = lambda element_id: browser.find_element(By.ID, element_id).get_attribute("textContent")  # noqa: E731
        turns = lambda kind: [t.get_attribute("textContent")  # noqa: E731
                              for t in browser.find_elements(By.CSS_SELECTOR, f".turn.{kind}")]
        key = browser.find_element(By.ID, "key")
        key.send_keys(KEYS[0], Keys.TAB)
        wait.until(lambda _: text("model") == MODEL)
        box = browser.find_element(By.ID, "prompt")
        box.send_keys(question, Keys.ENTER)
        box.send_keys("later", Keys.ENTER)  # while the reply streams
        wait.until(lambda _: text("state") in ("done", "failed"))
        assert turns("user") == [question] and turns("assistant") == [expected]
        assert box.get_attribute("value") == "later"
        # An earlier exchange longer than the server's 1024 positions: sent whole, no question would fit.
        browser.execute_script("history.push({role: 'user', content: 'Repeat.'}, "
                               "{role: 'assistant', content: 'one two three '.repeat(400)})")
        box.clear()
        box.send_keys(question, Keys.ENTER)
        wait.until(lambda _: text("state") in ("done", "failed"))
        assert text("state") == "done" and turns("assistant") == [expected, expected]
        assert turns("note") == ["2 earlier exchange(s) left out: the conversation outgrew the context"]
        browser.find_element(By.ID, "new").click()
        assert turns("user") == turns("assistant") == [] and browser.execute_script("return history.length") == 0
        assert text("tokens") == "0" and text("state") == "idle"
    finally:
        browser.quit()


def test_a_text_too_long_to_fit_is_refused_without_tokenizing_it(server, default_model, monkeypatch):
    """Tokenizing megabytes takes seconds on the one thread every request's prompt waits for: a text with more
    characters than max_length tokens of the longest piece could hold (times a slack) is refused before it."""
    from lookahead import serve

    url, _ = server
    _, tokenizer = default_model
    longest = max(map(len, tokenizer.get_vocab()))
    limit = serve.TEXT_SLACK * longest * 1024  # the fixture's max_length
    calls = []
    monkeypatch.setattr(serve.ChatRequest, "prompts", lambda *args: calls.append(args) or pytest.fail("tokenized"))
    monkeypatch.setattr(serve.CompletionRequest, "prompts", lambda *args: calls.append(args) or pytest.fail("tokenized"))
    for path, body, field in (
            ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a" * (limit + 1)}]},
             "messages"),
            ("completions", {"model": MODEL, "prompt": ["hi", "a" * (limit + 1)]}, "prompt")):
        code, reply = raw(f"{url}/v1/{path}", body)
        assert code == 400 and reply["error"]["param"] == field and reply["error"]["code"] == "context_length_exceeded"
        assert f"holds {limit + 1} characters of text" in reply["error"]["message"]
    assert not calls


def _sentencepiece_tokenizer():
    """A Llama 2-style tokenizer built here: BPE over '▁'-marked words with byte fallback, a BOS added to every
    text, and a decoder that strips a text's leading space."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    texts = ["Hello world, this is a test of the tokenizer.", "The quick brown fox jumps over the lazy dog.",
             "What is the capital of France? Paris is the capital of France."] * 20
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                           show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)


def test_a_sentencepiece_reply_keeps_its_first_space_and_echo_offsets_skip_the_bos():
    """Decoded alone, a reply's first word lost its space ("world," then "the": the decoder strips a text's
    leading space), so the echo read "world,the" and a stop string starting with a space went unseen; an echo's
    offsets counted the BOS token's text, which the echoed text does not hold, moving every one after it."""
    from conftest import _COMMON, peaked
    from fastapi.testclient import TestClient
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _sentencepiece_tokenizer()
    torch.manual_seed(0)
    model = peaked(LlamaForCausalLM(LlamaConfig(**{**_COMMON, "vocab_size": len(tokenizer)})), 0.15)
    the = tokenizer.convert_tokens_to_ids("\u2581the")
    body = {"model": MODEL, "prompt": "Hello world,", "max_tokens": 3, "temperature": 0, "logit_bias": {str(the): 100}}
    with TestClient(create_app(model, tokenizer, model_name=MODEL, max_batch=2, max_length=128)) as http:
        reply = http.post("/v1/completions", json=body).json()["choices"][0]
        assert reply["text"] == " the the the"
        echoed = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 0}).json()["choices"][0]
        assert echoed["text"] == "Hello world, the the the"
        offsets, tokens = echoed["logprobs"]["text_offset"], echoed["logprobs"]["tokens"]
        assert tokens == ["<s>", " Hello", " world,", " the", " the", " the"] and offsets == [0, 0, 5, 12, 16, 20]
        cut = http.post("/v1/completions", json={**body, "prompt": "Hello world, the", "stop": [" the the"]}).json()
        assert cut["choices"][0]["text"] == "" and cut["choices"][0]["finish_reason"] == "stop"
        streamed = http.post("/v1/completions", json={**body, "stream": True}).text
        pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert "".join(p["choices"][0]["text"] for p in pieces if p["choices"]) == " the the the"
