"""Lookahead parallelism: one sequence decoded by K processes that each hold the model.

Each step's window columns and guess subtrees are shared out among the processes (`core.split`); each
runs its share in one forward and the processes exchange only the token each row they own leads to
(the argmax, or the sample keyed by its position: one all-reduce of a few hundred integers per step). Every process then verifies and commits the same
tokens. Where the accepted guess ran on another process, this one has not computed its keys and values:
it feeds those tokens in front of its next step (recomputing them costs a few rows; exchanging them would
cost a second collective per step).

Launch: `torchrun --nproc-per-node K -m lookahead generate ...`, `lookahead generate --workers K`
(`run_workers` below), or call `parallel_generate` on every rank of an initialised process group
(gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from transformers import PreTrainedModel

from .config import LookaheadConfig
from .core.decoder import LookaheadDecoder
from .core.drafter import node_counts
from .core.split import split_step
from .engine import STEP_ROOM, GenerateOutput, GenerationStats, as_token_tensor, check_request, eos_ids, kept_tokens
from .generation import inferred_padding, new_token_count
from .hf import HFModelRunner, context_length
from .arguments import checked_int, checked_number
from .runtime.batch import StepInput, after_tokens, causal_step, pack_steps
from .sampling import DecodingOptions, decoding_rule

PREFILL_CHUNK = 512
DEFAULT_TIMEOUT = timedelta(seconds=60)
RESULT_FILE = "result.pickle"  # rank 0's, in the rendezvous folder


def parallel_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int | None = None,
    config: LookaheadConfig | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    group: dist.ProcessGroup | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int = 0,
) -> GenerateOutput:
    """Lookahead decoding of one prompt, its steps shared out among the processes of `group` (None: the
    default group). Call it on every rank with the same model, prompt and options; every rank returns the
    same output: greedy, token for token transformers' greedy `generate`; sampled (options as in
    `generate`), token for token what `generate(..., seed=seed)` draws in one process (for seeds in [0, 2**32)
    what `generator=torch.Generator().manual_seed(seed)` draws). max_new_tokens, do_sample and the sampling options
    None: the model's generation config's, as `generate` takes them left out.

    config: a fixed step (W, N, G); None means `LookaheadConfig()` (W5 N4 G5). A budgeted config is
    refused: its step sizes follow one device's measured cost curve, which the ranks need not share."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("parallel_generate needs an initialised process group: torch.distributed."
                           "init_process_group(...), torchrun, or `lookahead generate --workers K`")
    config = config or LookaheadConfig()
    if not isinstance(config, LookaheadConfig):
        raise TypeError(f"config must be a LookaheadConfig or None, got {type(config).__name__}")
    if config.budget:
        raise ValueError("parallel decoding takes a fixed step (LookaheadConfig with budget=False): a budgeted "
                         "step follows one device's cost curve")
    seed = checked_int("seed", seed, -2**63, 2**64 - 1, allowed="an integer in [-2**63, 2**64)")
    given = as_token_tensor(input_ids)
    max_new_tokens = new_token_count(model.generation_config, max_new_tokens, given.shape[-1] if given.dim() else 1,
                                     context_length(model))
    prompt = check_request(model, given, max_new_tokens)
    if given.dim() == 2:  # where generate, given no attention mask, reads the pad token as padding ([B, n] ids)
        _check_unpadded(model, prompt, eos_token_id)
    if do_sample is None:
        do_sample = bool(getattr(model.generation_config, "do_sample", False))
    rank, workers = dist.get_rank(group), dist.get_world_size(group)
    device = model.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    stops = eos_ids(model, eos_token_id)
    # Before any check that reads the generation config: were the ranks' to differ, one rank alone would refuse.
    _check_same_call(group, device, prompt, max_new_tokens, config, sorted(map(int, stops)),
                     [do_sample, temperature, top_k, top_p, repetition_penalty, seed],
                     sorted(model.generation_config.to_dict().items()))  # its processors apply on each rank
    check_one_process_settings(model)
    options = DecodingOptions(do_sample, temperature, top_k, top_p, repetition_penalty, seed=seed)
    rule = decoding_rule(model, options, prompt, max_new_tokens, stops)

    start = time.perf_counter()
    runner = HFModelRunner(model, packed_linear=False)
    # A step feeds at most STEP_ROOM rows (as on the engine) after the tokens it catches up, which are committed
    # tokens already: positions within the prompt and the new tokens.
    store = runner.new_store(1, prompt.numel() + max_new_tokens + STEP_ROOM)
    for begin in range(0, prompt.numel() - 1, PREFILL_CHUNK):  # every prompt token but the last
        chunk = prompt[begin: min(begin + PREFILL_CHUNK, prompt.numel() - 1)]
        runner.forward(store, pack_steps([0], [begin], [causal_step(chunk)]))
        store.extend(0, chunk.numel())
    decoder = LookaheadDecoder(config, prompt.tolist(), choose=rule.choose, transform=rule.transform,
                               context=context_length(model))
    stats = GenerationStats(window=decoder.window.width)
    generated: list[int] = []
    behind: list[int] = []  # committed tokens whose keys and values this rank has not computed
    while True:
        proposal = decoder.propose()
        plan = decoder.plan(proposal, node_counts([decoder.demand(proposal, most=STEP_ROOM)], None)[0])
        share = split_step(plan.layout, plan.tree.parents, workers)[rank]
        rows = share.rows
        step = after_tokens(torch.tensor(behind, dtype=torch.long),
                            StepInput(plan.tokens[rows], plan.layout.offsets[rows],
                                      plan.layout.allowed[rows][:, rows], share.logit_rows))
        logits = runner.forward(store, pack_steps([0], [store.lengths[0]], [step]))[0]
        picked = torch.full((plan.layout.logit_rows.numel(),), -1, dtype=torch.long, device=device)
        picked[share.owned.to(device)] = decoder.choices(plan, logits, share.owned).to(device)
        dist.all_reduce(picked, op=dist.ReduceOp.MAX, group=group)
        result = decoder.update_from_choices(plan, picked.cpu())
        stats.steps += 1
        stats.tokens_fed += step.tokens.numel()
        tokens, finished = kept_tokens(result.tokens, max_new_tokens - len(generated), set(stops))
        generated += tokens
        stats.accepted_per_step.append(len(tokens))
        if finished:
            break
        # Keep the caught-up tokens, row 0, and the accepted guess where this rank ran it.
        local = share.place[result.kept_rows]
        if bool((local >= 0).all()):
            kept, behind = local, []
        else:
            kept, behind = local[:1], result.tokens[:-1]
        caught_up = step.tokens.numel() - rows.numel()
        store.keep(0, torch.cat([torch.arange(caught_up), kept + caught_up]))
    stats.new_tokens = len(generated)
    stats.seconds = time.perf_counter() - start
    stats.forward_seconds = runner.forward_seconds
    stats.accepted_by_source = dict(decoder.accepted_by_source)
    sequences = torch.cat([prompt, torch.tensor(generated, dtype=torch.long)]).view(1, -1)
    return GenerateOutput(sequences, stats)


def check_one_process_settings(model: PreTrainedModel) -> None:
    """Raise where the model's generation config sets what only one process applies: stop strings and max_time,
    which stop `generate` at a point that the processes, each stepping on its own clock and without the
    tokenizer, would not agree on; scores and logits, which parallel_generate does not return."""
    settings = model.generation_config
    for name in ("stop_strings", "max_time"):
        if getattr(settings, name, None) is not None:
            raise ValueError(f"the model's generation config sets {name}={getattr(settings, name)!r}, which the "
                             "processes of lookahead parallelism do not apply: decode in one process, or unset it")
    for name in ("output_scores", "output_logits"):
        if getattr(settings, name, None):
            raise ValueError(f"the model's generation config sets {name}=True, and parallel_generate returns no "
                             "scores or logits: decode in one process (`generate`), or unset it")


def _check_unpadded(model: PreTrainedModel, prompt: torch.Tensor, eos_token_id) -> None:
    """Raise where a [1, n] prompt holds the pad token that `generate`, given no attention mask, reads as padding:
    parallel_generate takes one prompt and no mask, and would decode the padding as text."""
    padding = inferred_padding(model, model.generation_config, eos_token_id, None)
    if padding is not None and bool((prompt == padding).any()):
        raise ValueError(f"input_ids holds the pad token (id {padding}), which generate reads as padding without an "
                         "attention mask: parallel_generate takes one prompt without padding; remove it")


def _check_same_call(group, device: torch.device, *arguments) -> None:
    """Raise on every rank if the ranks were not given the same prompt and options, the model's generation config
    among them (they would decode different steps and wait on each other)."""
    digest = hashlib.blake2b(repr([a.tolist() if isinstance(a, torch.Tensor) else a for a in arguments]).encode(),
                             digest_size=7).digest()
    mine = torch.tensor([int.from_bytes(digest, "big")], dtype=torch.long, device=device)
    lowest, highest = mine.clone(), mine.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    if int(lowest) != int(highest):
        raise ValueError("the ranks were given different prompts, options or generation configs; parallel_generate "
                         "needs the same call on every rank")


class WorkerError(RuntimeError):
    """A process of `run_workers` failed (the others were stopped)."""


def run_workers(workers: int, target: Callable[..., object], *args, threads: int | None = None,
                timeout: timedelta | float = DEFAULT_TIMEOUT) -> object:
    """Runs `target(*args)` in `workers` local processes joined in a gloo process group (each with
    `threads` torch threads; default: the cores shared out) and returns rank 0's result. `target` must be
    importable by name (a module-level function). If a process fails, the others are stopped at once and
    WorkerError names the one that failed first and why (not the others, whose collectives failed on
    losing it); a collective waits at most `timeout` (a timedelta, or seconds) for a process that hangs. Workers
    whose caller is gone (killed by a signal that ran no clean-up) stop within a second."""
    workers = checked_int("workers", workers, 1)
    threads = max(1, (os.cpu_count() or 1) // workers) if threads is None else checked_int("threads", threads, 1)
    if not isinstance(timeout, timedelta):
        checked_number("timeout", timeout, lambda v: 0 < v <= 1e9, "a timedelta or a number of seconds in (0, 1e9]")
        timeout = timedelta(seconds=float(timeout))
    main = sys.modules.get("__main__")
    if getattr(target, "__module__", None) == "__main__" and getattr(main, "__file__", None) is None:
        raise ValueError(f"target {getattr(target, '__qualname__', target)!r} is defined in an interactive session "
                         "or `python -c`: the workers cannot import it by name; define it in a module or a script")
    # Workers fork from a server process that imported torch and transformers once (kept for later calls),
    # instead of each importing them afresh: 5-10 s per worker on 2 CPU cores, several at once. They are
    # given the caller's environment as it is now, not the server's from when it started.
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"  # no forkserver on Windows
    processes = mp.get_context(method)
    if method == "forkserver":
        processes.set_forkserver_preload(["torch", "transformers", __name__])
    messages = processes.SimpleQueue()
    # A pipe that nothing is sent through: the workers read its end until the caller's end closes, which the
    # kernel does when the caller dies, however (a signal that runs no clean-up; reaped or not, pid reused or not).
    watched, caller_end = processes.Pipe(duplex=False)
    # The workers meet through a file of their own, not a TCP port picked free beforehand: two calls at once (two
    # test processes, say) could pick the same port between its probe and its use, and one group's worker then
    # joined the other's (a fresh-clone CI run, session 28: "Connection closed by peer", a worker exiting).
    # (A worker whose caller's end closed removes it too: whichever comes second finds nothing left to remove.)
    with tempfile.TemporaryDirectory(prefix="lookahead-workers-", ignore_cleanup_errors=True) as rendezvous:
        context = mp.start_processes(_worker, (workers, rendezvous, threads, timeout, dict(os.environ), watched,
                                               messages, target, args),
                                     nprocs=workers, join=False, start_method=method)
        received: list[tuple[str, object]] = []

        def drain() -> None:
            while not messages.empty():
                received.append(messages.get())

        # Messages are read while the workers run (each small: a result comes through a file).
        try:
            while not context.join(timeout=0.05):
                drain()
        except ProcessException:
            drain()
            raise WorkerError(_first_failure(context.processes, received, workers)) from None
        except BaseException:  # the caller interrupted (Ctrl-C, a signal's exception): its workers stop too
            _stop(context.processes)
            raise
        finally:
            watched.close()
            caller_end.close()
            for path in context.error_files:  # torch's, one per worker, holding a failed one's traceback
                with contextlib.suppress(OSError):
                    os.remove(path)
        drain()
        if ("result", None) not in received:  # every worker exited 0, rank 0 without a result (sys.exit, say)
            raise WorkerError(_first_failure(context.processes, received, workers)
                              if any(kind == "error" for kind, _ in received) else
                              f"worker 0 of {workers} exited without a result (exit code {context.processes[0].exitcode})")
        with open(os.path.join(rendezvous, RESULT_FILE), "rb") as result:
            return pickle.load(result)


def _stop(processes, grace: float = 5.0) -> None:
    """Terminate the workers still running, then kill those that outlast `grace` seconds."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=grace)
        if process.is_alive():
            process.kill()
            process.join()


def _first_failure(processes, received: list[tuple[str, object]], workers: int) -> str:
    """What went wrong first: the earliest exception a worker reported, unless it only says that another
    worker went away; else a worker that exited without a word (killed, os._exit), or that hung."""
    failures = sorted(payload for kind, payload in received if kind == "error")  # (when, rank, last line)
    collateral = ("Connection closed by peer", "Connection reset by peer", "Timed out")
    for _, rank, line in failures:
        if not any(words in line for words in collateral):
            return f"worker {rank} of {workers} failed: {line}"
    reported = {rank for _, rank, _ in failures}
    for rank, process in enumerate(processes):
        process.join(timeout=5)
        if rank not in reported and process.exitcode not in (0, None, -signal.SIGTERM):
            return f"worker {rank} of {workers} exited with code {process.exitcode}"
    # Those that reported nothing and were stopped (torch stops the rest once one fails), where every report is a
    # time-out: they hung, and the others timed out waiting for them.
    silent = [rank for rank, process in enumerate(processes)
              if rank not in reported and process.exitcode in (None, -signal.SIGTERM)]
    if failures and silent and all("Timed out" in line for _, _, line in failures):
        return f"worker {silent[0]} of {workers} stopped answering (the others timed out waiting for it; it was stopped)"
    if failures:
        _, rank, line = failures[0]
        return f"worker {rank} of {workers} failed: {line}"
    return f"a worker of {workers} failed without a message"


def _leave_with(watched, rendezvous: str, rank: int) -> None:
    """Ends this worker once the process that started it is gone (`watched`: the end of a pipe whose other end
    only the caller holds): one killed by a signal that ran no clean-up (SIGTERM, SIGKILL) stops none of its
    workers, which would decode on, or wait in a collective until the time-out, and leave the rendezvous folder
    behind (rank 0 removes it)."""
    try:
        watched.recv()  # nothing is ever sent: this ends when the caller's end closes
    except (EOFError, OSError):
        pass
    if rank == 0:
        shutil.rmtree(rendezvous, ignore_errors=True)
    os._exit(1)


def _worker(rank: int, workers: int, rendezvous: str, threads: int, timeout: timedelta, environment: dict[str, str],
            watched, messages, target, args) -> None:
    os.environ.clear()
    os.environ.update(environment)
    threading.Thread(target=_leave_with, args=(watched, rendezvous, rank), daemon=True).start()
    try:
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=rank, world_size=workers, timeout=timeout)
        # Every worker connected before any goes on: a worker's side of the mesh can be up while another's is
        # still connecting, and a target without collectives could then end and close it under that one
        # ("connectFullMesh failed: Connection closed by peer": 2 of 60 calls on a busy machine, none of 120 after).
        dist.barrier()
        result = target(*args)
        if rank == 0:
            # Through a file, put in place whole: a worker killed while writing to the queue would leave the caller
            # waiting on the rest of a message. Plain pickle: tensors by value, not as shared memory.
            with tempfile.NamedTemporaryFile(dir=rendezvous, delete=False) as partial:
                pickle.dump(result, partial)
            os.replace(partial.name, os.path.join(rendezvous, RESULT_FILE))
            messages.put(("result", None))
    except BaseException as error:
        # Said before the process group goes down, so that it comes before the other workers' failures.
        lines = [line for line in traceback.format_exception_only(error)[-1].strip().splitlines() if line.strip()]
        messages.put(("error", (time.monotonic(), rank, lines[-1] if lines else type(error).__name__)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
