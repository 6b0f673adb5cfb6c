"""Load benchmark of `lookahead serve`: N concurrent streaming chat clients on loopback, bounded in requests
and time, with lookahead off and on against the same server; time to first token, inter-token latency,
throughput and failures per mode. The machine's speed drifts within minutes, so the modes run in rounds,
each in the reverse order of the round before; a server keeps a corpus of earlier replies per API key, so
each round's modes use keys of their own (drafting from replies to the same prompts would flatter lookahead)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

MODES = ("auto", "off")
WARM_UP = "Say hello."  # not in any workload, so that warming up teaches the corpus nothing about it


@dataclass
class StreamResult:
    """One streamed request, as its client saw it."""

    prompt: int  # index into the prompts
    error: str | None = None
    text: str = ""
    tokens: int = 0
    steps: int = 0
    first_token: float | None = None  # seconds from sending the request
    # Seconds between tokens after the first event (a step's tokens share its gap; those that came with the
    # first token count in none).
    gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class LoadRun:
    """One mode: every client's requests together."""

    mode: str
    clients: int
    requests: int
    failed: int
    seconds: float  # wall time from the first request sent to the last reply finished
    tokens: int
    steps: int
    first_token_p50: float
    first_token_p99: float
    inter_token_p50: float
    inter_token_p99: float
    identical: int | None = None  # "auto": replies equal to the same prompt's reply with lookahead off
    errors: tuple[str, ...] = ()  # what failed requests got, each different message once (the first 5)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)


def stream_chat(url: str, model: str, content: str, max_tokens: int, mode: str, api_key: str | None,
                timeout: float, prompt: int = 0) -> StreamResult:
    """One streaming chat completion, read event by event with the standard library (no client package)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "lookahead": mode}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    result = StreamResult(prompt)
    start = time.perf_counter()
    last = None
    try:
        request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                progress = chunk.get("lookahead")
                if progress is None or progress["tokens"] == result.tokens:
                    continue
                now = time.perf_counter()
                new = progress["tokens"] - result.tokens
                if last is None:  # tokens that came with the first one had no interval: none counted
                    result.first_token = now - start
                else:
                    result.gaps += [(now - last) / new] * new
                last = now
                result.tokens, result.steps = progress["tokens"], progress["steps"]
                result.text += chunk["choices"][0]["delta"].get("content") or ""
    except urllib.error.HTTPError as error:
        result.error = f"HTTP {error.code}: {error.read().decode(errors='replace')[:200]}"
    except (OSError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.seconds = time.perf_counter() - start
    return result


def load_run(url: str, model: str, prompts: Sequence[str], clients: int, max_tokens: int, mode: str,
             api_key: str | None = None, time_limit: float = 600.0) -> tuple[LoadRun, list[StreamResult]]:
    """`clients` threads take the prompts in turn, one streaming request at a time each, until the prompts
    run out or `time_limit` seconds have passed (no new request starts after it)."""
    pending = iter(range(len(prompts)))
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + time_limit

    def client() -> list[StreamResult]:
        done = []
        while time.perf_counter() < deadline:
            with lock:
                index = next(pending, None)
            if index is None:
                break
            done.append(stream_chat(url, model, prompts[index], max_tokens, mode, api_key,
                                    timeout=max(deadline - time.perf_counter(), 1.0) + 60, prompt=index))
        return done

    with ThreadPoolExecutor(clients) as pool:
        results = sorted((r for part in pool.map(lambda _: client(), range(clients)) for r in part),
                         key=lambda r: r.prompt)
    return _summary(mode, clients, results, time.perf_counter() - start), results


def _summary(mode: str, clients: int, results: Sequence[StreamResult], seconds: float,
             identical: int | None = None) -> LoadRun:
    good = [r for r in results if r.error is None]
    first = [r.first_token for r in good if r.first_token is not None]
    gaps = [gap for r in good for gap in r.gaps]
    pct = lambda values, q: float(np.percentile(values, q)) if values else float("nan")  # noqa: E731
    errors = tuple(dict.fromkeys(r.error for r in results if r.error is not None))[:5]
    return LoadRun(mode, clients, len(results), len(results) - len(good), seconds, sum(r.tokens for r in good),
                   sum(r.steps for r in good), pct(first, 50), pct(first, 99), pct(gaps, 50), pct(gaps, 99), identical,
                   errors)


def serve_load(url: str, model: str, prompts: Sequence[str], clients: int, max_tokens: int,
               keys: Sequence[str | None] = (None,), time_limit: float = 600.0, rounds: int = 1,
               on_run: Callable[[LoadRun], None] | None = None) -> list[LoadRun]:
    """Lookahead on and off against one server, in `rounds` rounds, each in the reverse order of the one
    before; round r's modes send the API keys `keys[2r]` and `keys[2r + 1]` (wrapping around: give 2 x rounds
    keys of a server that keeps a corpus per key, or one key, one round). Each mode is warmed up first by two
    waves of `clients` concurrent short requests of different lengths, so that sequences join and leave a
    running batch (a server that compiles its steps compiles the shapes that meets then, not while measured).
    The "auto" run counts its replies that equal the "off" reply to the same prompt in the same round."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    seconds = dict.fromkeys(MODES, 0.0)
    results: dict[str, list[StreamResult]] = {mode: [] for mode in MODES}
    same = 0
    warm_up = [" ".join([WARM_UP] * (1 + i % 3)) for i in range(2 * clients)]
    for round_ in range(rounds):
        texts = {}
        for mode in MODES[::-1] if round_ % 2 else MODES:
            key = keys[(2 * round_ + MODES.index(mode)) % len(keys)]
            load_run(url, model, warm_up, clients, 8, mode, key, time_limit)
            run, done = load_run(url, model, prompts, clients, max_tokens, mode, key, time_limit)
            seconds[mode] += run.seconds
            results[mode] += done
            texts[mode] = {r.prompt: r.text for r in done if r.error is None}
            if on_run is not None:
                on_run(run)
        same += sum(texts["off"].get(i) == text for i, text in texts["auto"].items())
    return [_summary("off", clients, results["off"], seconds["off"]),
            _summary("auto", clients, results["auto"], seconds["auto"], same)]


def load_table(runs: Sequence[LoadRun]) -> str:
    off = next(r for r in runs if r.mode == "off")
    lines = ["| lookahead | clients | requests | failed | tokens/s | vs off | tokens/step | TTFT p50 (s) | TTFT p99 (s) | "
             "ITL p50 (ms) | ITL p99 (ms) | same reply as off |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        same = "–" if r.identical is None else f"{r.identical}/{r.requests - r.failed}"
        ratio = f"{r.tokens_per_second / off.tokens_per_second:.2f}x" if off.tokens_per_second else "–"  # all failed
        lines.append(f"| {r.mode} | {r.clients} | {r.requests} | {r.failed} | {r.tokens_per_second:.1f} | "
                     f"{ratio} | {r.tokens_per_step:.2f} | "
                     f"{r.first_token_p50:.2f} | {r.first_token_p99:.2f} | {1000 * r.inter_token_p50:.1f} | "
                     f"{1000 * r.inter_token_p99:.1f} | {same} |")
    return "\n".join(lines)
