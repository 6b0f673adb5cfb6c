"""Lookahead parallelism: the split of a step among workers (properties), and real gloo process groups on
tiny models, the default model and through the CLI and torchrun, each compared with transformers' greedy
`generate`; failures and bad launches end with a clear error, not a hang."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, make_tiny_model, reference_greedy
from conftest import run_cli as run
from hypothesis import given
from hypothesis import strategies as st

from lookahead import LookaheadConfig, generate
from lookahead.core.layout import build_guess_tree, step_layout
from lookahead.core.split import split_step
from lookahead.parallel import WorkerError, parallel_generate, run_workers
from lookahead.prompts import encode_prompt

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7, 8, 11]
CONFIGS = [(5, 4, 5), (7, 5, 7), (3, 2, 3), (0, 3, 4), (4, 3, 0), (15, 5, 15)]


@given(levels=st.integers(0, 5), width=st.integers(1, 9), workers=st.integers(1, 5),
       guesses=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=12))
def test_a_split_runs_every_row_its_rows_attend_to_and_owns_each_logit_row_once(levels, width, workers, guesses):
    tree = build_guess_tree(guesses)
    layout = step_layout(levels, width if levels else 0, tree)
    shares = split_step(layout, tree.parents, workers)
    assert len(shares) == workers
    owned = torch.cat([share.owned for share in shares]).sort().values
    assert torch.equal(owned, torch.arange(layout.logit_rows.numel()))  # each logit row exactly once
    for share in shares:
        runs = torch.zeros(layout.size, dtype=torch.bool)
        runs[share.rows] = True
        assert bool(runs[0]) and torch.equal(share.rows, share.rows.sort().values)
        # Closed under attention: whatever a row attends to inside the step runs on the same worker.
        assert not bool((layout.allowed[share.rows] & ~runs).any())
        assert torch.equal(share.rows[share.logit_rows], layout.logit_rows[share.owned])
        assert torch.equal(share.place >= 0, runs) and torch.equal(share.place[share.rows], torch.arange(share.rows.numel()))
    if workers == 1:
        assert torch.equal(shares[0].rows, torch.arange(layout.size))


def test_a_wide_step_is_shared_out_evenly():
    tree = build_guess_tree([[t, t + 1, t + 2, t + 3] for t in range(15)])  # 15 subtrees of 4 nodes
    layout = step_layout(4, 15, tree)  # W15 N5 G15: 1 + 60 + 60 rows
    two = split_step(layout, tree.parents, 2)
    # Worker 0: row 0, columns 0-7 (level 0 and levels 1-3: 32 rows), 8 subtrees; worker 1: row 0, level 0
    # of all 15 columns and levels 1-3 of columns 8-14 (36 rows), 7 subtrees: 65 rows each.
    assert [share.rows.numel() for share in two] == [65, 65]
    assert two[0].rows[1:9].tolist() == list(range(1, 9)) and two[1].rows[1:16].tolist() == list(range(1, 16))
    sizes = [share.rows.numel() for share in split_step(layout, tree.parents, 3)]
    assert max(sizes) - min(sizes) <= 4 and sum(sizes) == layout.size + 2 + 5 + 10  # row 0 twice more, level 0 of 5 and 10 columns


def test_subtrees_go_largest_first_to_the_least_loaded_worker():
    """One window level of 2 columns (rows 1, 2), five one-node guesses (rows 3-7) and a five-node chain
    (rows 8-12), listed last. The chain goes first, to the worker with the least window rows."""
    tree = build_guess_tree([[10], [11], [12], [13], [14], [20, 21, 22, 23, 24]])
    layout = step_layout(1, 2, tree)
    two = split_step(layout, tree.parents, 2)
    assert [share.rows.tolist() for share in two] == [[0, 1, 7, 8, 9, 10, 11, 12], [0, 1, 2, 3, 4, 5, 6]]
    assert [share.owned.tolist() for share in two] == [[0, 1, 7, 8, 9, 10, 11, 12], [2, 3, 4, 5, 6]]
    three = split_step(layout, tree.parents, 3)  # worker 2 has no column: no window row at all
    assert [share.rows.tolist() for share in three] == [[0, 1, 3, 4, 6], [0, 1, 2, 5, 7], [0, 8, 9, 10, 11, 12]]
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        split_step(layout, tree.parents, 0)


def test_a_workers_load_counts_every_level_of_its_columns_and_the_level_0_rows_before_them():
    """W3 N5: worker 0 runs columns 0-1 (8 window rows), worker 1 column 2 and level 0 of columns 0-1
    (6 rows). The 3-node chain goes to worker 1, the lighter, and the single node to worker 0."""
    tree = build_guess_tree([[20, 21, 22], [10]])  # rows 13-15 and 16
    layout = step_layout(4, 3, tree)
    shares = split_step(layout, tree.parents, 2)
    assert [share.rows.tolist() for share in shares] == [[0, 1, 2, 4, 5, 7, 8, 10, 11, 16],
                                                         [0, 1, 2, 3, 6, 9, 12, 13, 14, 15]]


def _decode_tiny(cases: list[tuple[str, tuple[int, int, int]]]) -> list[list[int]]:
    """One process's part of decoding every case (a tiny family, a W,N,G), in a process group."""
    return [parallel_generate(make_tiny_model(family), PROMPT, 40, LookaheadConfig(*config),
                              eos_token_id=[]).sequences[0].tolist() for family, config in cases]


@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_workers_give_greedy_generate_token_for_token_on_tiny_models(workers):
    cases = [(family, config) for family in FAMILIES for config in CONFIGS[:3]] + [("llama", c) for c in CONFIGS[3:]]
    outputs = run_workers(workers, _decode_tiny, cases, threads=1)
    for (family, config), output in zip(cases, outputs):
        expected = reference_greedy(make_tiny_model(family), torch.tensor([PROMPT]), 40, eos_token_id=[])
        assert output == expected[0].tolist(), (family, config)


def _long_drafts(prompt: list[int]) -> list[int]:
    """Suffix drafts of up to 32 tokens: steps far taller than the window and the pool make."""
    config = LookaheadConfig(window=0, ngram=2, guesses=1, suffix=32)
    return parallel_generate(make_tiny_model("llama"), prompt, 40, config, eos_token_id=[]).sequences[0].tolist()


def test_long_suffix_drafts_fit_the_workers_kv_store():
    """A prompt holding the model's own continuation twice: the suffix source proposes long drafts, which
    had overflowed the store the workers sized for the window and the pool alone."""
    free = reference_greedy(make_tiny_model("llama"), torch.tensor([PROMPT]), 40, eos_token_id=[])[0].tolist()
    prompt = free + PROMPT
    expected = reference_greedy(make_tiny_model("llama"), torch.tensor([prompt]), 40, eos_token_id=[])[0].tolist()
    assert run_workers(2, _long_drafts, prompt, threads=1) == expected


def _big_result(size: int) -> bytes:
    return bytes(range(256)) * (size // 256)


def test_a_result_larger_than_a_pipe_buffer_comes_back():
    """Rank 0's result comes back whole (through the queue it had hung, blocked in its write, past 64 KiB; it
    comes through a file since, which a worker killed mid-write cannot leave half-sent)."""
    assert run_workers(2, _big_result, 1 << 20, threads=1) == _big_result(1 << 20)


def _sample_tiny(seeds: list[int]) -> list[list[int]]:
    model = make_tiny_model("llama")
    return [parallel_generate(model, PROMPT, 40, LookaheadConfig(7, 4, 7), eos_token_id=[], do_sample=True,
                              temperature=0.8, top_k=20, repetition_penalty=1.2, seed=seed).sequences[0].tolist()
            for seed in seeds]


def test_sampling_across_workers_draws_what_one_process_draws():
    """The token of every position is the sample keyed by (seed, position), whichever process picked it:
    two workers draw, token for token, what `generate` draws alone with the same seed."""
    seeds = [0, 1, 2, 3]
    outputs = run_workers(2, _sample_tiny, seeds, threads=1)
    model = make_tiny_model("llama")
    alone = [generate(model, PROMPT, max_new_tokens=40, config=LookaheadConfig(7, 4, 7), eos_token_id=[], do_sample=True, temperature=0.8,
                      top_k=20, repetition_penalty=1.2, generator=torch.Generator().manual_seed(seed)
                      ).sequences[0].tolist() for seed in seeds]
    assert outputs == alone
    assert len({tuple(o) for o in outputs}) == len(seeds)  # the seeds draw different texts


def _fail_on_rank_one(how: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "raise":
            raise ValueError("rank one gives up")
        if how == "hang":
            time.sleep(600)
        os._exit(3)
    parallel_generate(make_tiny_model("llama"), PROMPT, 400, LookaheadConfig(), eos_token_id=[])


@pytest.mark.parametrize("how, words", [("raise", "worker 1 of 2 failed: ValueError: rank one gives up"),
                                        ("exit", "worker 1 of 2 exited with code 3"),
                                        ("hang", "worker 1 of 2 stopped answering (the others timed out waiting")])
def test_a_worker_that_dies_ends_the_run_with_a_clear_error(how, words):
    """The error names the worker that failed first and why, not the collateral failures of the others (a hung
    one had been named by the time-out of another)."""
    with pytest.raises(WorkerError, match=words.replace("(", r"\(")):
        run_workers(2, _fail_on_rank_one, how, threads=1, timeout=timedelta(seconds=5))


def _exit_quietly(how: str) -> None:
    if how == "sys.exit":
        sys.exit(0)
    os._exit(0)


@pytest.mark.parametrize("how, words", [("sys.exit", "worker [01] of 2 failed: SystemExit"),
                                        ("os._exit", r"worker 0 of 2 exited without a result \(exit code 0\)")])
def test_workers_that_exit_0_without_a_result_end_the_run_with_a_clear_error(how, words):
    """Every worker exited 0 and rank 0 sent no result: the caller had raised a bare StopIteration."""
    with pytest.raises(WorkerError, match=words):
        run_workers(2, _exit_quietly, how, threads=1)


def test_a_failed_run_leaves_no_file_behind(tmp_path, monkeypatch):
    """torch's start_processes writes an error file per worker, which it never removes: each failed call had
    left one (a traceback) per failing worker in the temporary folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(WorkerError, match="rank one gives up"):
        run_workers(2, _fail_on_rank_one, "raise", threads=1)
    assert list(tmp_path.iterdir()) == []


def _sleep_marked(folder: str) -> None:
    Path(folder, str(os.getpid())).touch()
    time.sleep(120)


def test_workers_stop_when_their_caller_is_interrupted(tmp_path, monkeypatch):
    """A Ctrl-C (or any exception) in the caller while its workers run stops them too: they do not decode on in
    the background, nor keep the caller's process from exiting."""
    import lookahead.parallel

    start_processes = lookahead.parallel.mp.start_processes

    def interrupted_once_started(*args, **kwargs):
        context = start_processes(*args, **kwargs)
        join = context.join

        def join_then_interrupt(timeout=None):
            if len(list(tmp_path.iterdir())) == 2:  # both workers run
                raise KeyboardInterrupt
            return join(timeout)

        context.join = join_then_interrupt
        return context

    monkeypatch.setattr(lookahead.parallel.mp, "start_processes", interrupted_once_started)
    with pytest.raises(KeyboardInterrupt):
        run_workers(2, _sleep_marked, str(tmp_path), threads=1)

    pids = [int(path.name) for path in tmp_path.iterdir()]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def _misuse(case: str) -> None:
    import torch.distributed as dist

    model = make_tiny_model("llama")
    if case == "budget":
        parallel_generate(model, PROMPT, 8, LookaheadConfig(budget=True))
    if case == "prompts":
        parallel_generate(model, PROMPT[: 5 + dist.get_rank()], 8)
    if case == "generation configs":  # rank 1 would suppress a token that rank 0 may pick
        model.generation_config.suppress_tokens = [7] * dist.get_rank() or None
        parallel_generate(model, PROMPT, 8)
    if case in ("stop_strings", "max_time"):  # what one process applies (with the tokenizer, on its clock)
        setattr(model.generation_config, case, "x" if case == "stop_strings" else 1e-4)
        parallel_generate(model, PROMPT, 8)
    if case in ("output_scores", "output_logits"):  # generate returns them; parallel_generate had said nothing
        setattr(model.generation_config, case, True)
        parallel_generate(model, PROMPT, 8)
    if case == "padding":  # generate reads the pad token as padding; parallel_generate had decoded it as text
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
        parallel_generate(model, torch.tensor([[0, 0] + PROMPT]), 8)  # (a 1-D prompt is read as it is, as generate does)
    if case == "seed":
        parallel_generate(model, PROMPT, 8, seed=1.5)
    if case == "scalar":
        parallel_generate(model, torch.tensor(5), 8)


@pytest.mark.parametrize("case, words", [("budget", "fixed step"), ("prompts", "different prompts"),
                                         ("generation configs", "options or generation configs"),
                                         ("stop_strings", "sets stop_strings='x'"), ("max_time", "sets max_time=0.0001"),
                                         ("output_scores", "sets output_scores=True"),
                                         ("output_logits", "sets output_logits=True"),
                                         ("padding", r"holds the pad token \(id 0\), which generate reads as padding"),
                                         ("seed", r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got 1.5"),
                                         ("scalar", r"input_ids must have shape \[n\] or \[B, n\]")])
def test_misuse_is_refused_on_every_rank(case, words):
    with pytest.raises(WorkerError, match=words):
        run_workers(2, _misuse, case, threads=1)


def _sampled_by_the_generation_config() -> tuple[list[int], list[int], list[int]]:
    model = make_tiny_model("llama")
    model.generation_config.do_sample, model.generation_config.temperature = True, 1.5
    config = LookaheadConfig(4, 3, 4)
    return tuple(parallel_generate(model, PROMPT, 24, config, eos_token_id=[], seed=5, **sample).sequences[0].tolist()
                 for sample in ({}, {"do_sample": True}, {"do_sample": False}))


def _lengths_from_the_generation_config() -> tuple[int, int]:
    model = make_tiny_model("llama")
    model.generation_config.max_new_tokens = 10
    by_new_tokens = parallel_generate(model, PROMPT, config=LookaheadConfig(4, 3, 4), eos_token_id=[])
    model.generation_config.max_new_tokens, model.generation_config.max_length = None, len(PROMPT) + 6
    by_length = parallel_generate(model, PROMPT, config=LookaheadConfig(4, 3, 4), eos_token_id=[])
    return by_new_tokens.sequences.shape[1] - len(PROMPT), by_length.sequences.shape[1] - len(PROMPT)


def _one_row_holding_the_pad_token() -> list[int]:
    model = make_tiny_model("llama")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return parallel_generate(model, [5, 0] + PROMPT, 12, LookaheadConfig(4, 3, 4), eos_token_id=[]).sequences[0].tolist()


def test_a_one_dimensional_prompt_holding_the_pad_token_is_read_as_generate_reads_it():
    """Only [B, n] ids have their pad tokens read as padding by generate: a 1-D prompt is decoded as it is."""
    model = make_tiny_model("llama")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    expected = generate(model, [5, 0] + PROMPT, max_new_tokens=12, eos_token_id=[]).sequences[0].tolist()
    assert run_workers(2, _one_row_holding_the_pad_token, threads=1) == expected


def test_max_new_tokens_unset_is_the_generation_configs_as_in_generate():
    """It had been 128 whatever the generation config said (generate: its max_new_tokens, else max_length)."""
    assert run_workers(2, _lengths_from_the_generation_config, threads=1) == (10, 6)


def test_do_sample_unset_is_the_generation_configs_as_in_generate():
    default, sampled, greedy = run_workers(2, _sampled_by_the_generation_config, threads=1)
    assert default == sampled and default != greedy


def _with_a_numpy_stop_token() -> list[int]:
    import numpy as np

    model = make_tiny_model("llama")
    model.generation_config.eos_token_id = np.int64(PROMPT[3])  # no JSON for it: the ranks compare it all the same
    return parallel_generate(model, PROMPT, 16, LookaheadConfig(4, 3, 4)).sequences[0].tolist()


def test_a_generation_config_with_numpy_values_is_compared_across_ranks():
    model = make_tiny_model("llama")
    expected = reference_greedy(model, torch.tensor([PROMPT]), 16, eos_token_id=[PROMPT[3]])[0].tolist()
    assert run_workers(2, _with_a_numpy_stop_token, threads=1) == expected


def test_bad_run_workers_arguments_are_refused_before_any_worker_starts(monkeypatch):
    import types

    import lookahead.parallel

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr(lookahead.parallel.mp, "start_processes", no_workers)
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"threads must be an integer >= 1, got"):
            run_workers(2, _environment_variable, "X", threads=threads)
    for timeout in ("5", -1, 0, float("inf"), 1e15, True):
        with pytest.raises(ValueError, match=r"timeout must be a timedelta or a number of seconds in \(0, 1e9\], got"):
            run_workers(2, _environment_variable, "X", timeout=timeout)

    def typed_in_a_session() -> None: ...

    typed_in_a_session.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # `python -c`: no file
    with pytest.raises(ValueError, match="interactive session or `python -c`"):
        run_workers(2, typed_in_a_session)


def test_a_timeout_in_seconds_is_taken():
    assert run_workers(2, _environment_variable, "LOOKAHEAD_NOT_SET", threads=1, timeout=30) is None


CALLER = """
import os, sys, time
from pathlib import Path
from lookahead.parallel import run_workers

def marked(folder):
    Path(folder, str(os.getpid())).touch()
    time.sleep(120)

if __name__ == "__main__":
    run_workers(2, marked, sys.argv[1], threads=1)
"""


def test_workers_stop_when_their_caller_is_killed(tmp_path):
    """A caller killed by a signal that runs no clean-up of its own (SIGTERM's default, as SIGKILL): its workers
    stop within a second or so, and the rendezvous folder goes with them, before the caller is reaped (a zombie's
    pid still answers)."""
    # The caller's TMPDIR short: multiprocessing's forkserver binds a socket under it, and a path of pytest's
    # (/tmp/pytest-of-root/pytest-101/popen-gw0/test_workers_stop_.../tmp/...) ran past AF_UNIX's 107 characters.
    marks, scratch = tmp_path / "marks", Path(tempfile.mkdtemp(prefix="lw"))
    marks.mkdir()
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen([sys.executable, str(script), str(marks)], env={**os.environ, "TMPDIR": str(scratch)})
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.1)
        pids = [int(path.name) for path in marks.iterdir()]
        assert len(pids) == 2 and list(scratch.glob("lookahead-workers-*"))
        caller.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids) and _alive(caller.pid)  # a zombie until this test reaps it
        assert not list(scratch.glob("lookahead-workers-*"))
        caller.wait(timeout=30)
    finally:
        caller.kill()
        for pid in [int(path.name) for path in marks.iterdir()]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _environment_variable(name: str) -> str | None:
    return os.environ.get(name)


def test_workers_get_the_callers_environment_as_it_is_at_the_call(monkeypatch):
    """Workers fork from a server process that an earlier call started; they still get this call's
    environment (a cache folder set in between, say), not the server's."""
    assert run_workers(2, _environment_variable, "LOOKAHEAD_TEST_MARK", threads=1) is None
    monkeypatch.setenv("LOOKAHEAD_TEST_MARK", "set since")
    assert run_workers(2, _environment_variable, "LOOKAHEAD_TEST_MARK", threads=1) == "set since"


def test_without_a_process_group_parallel_generate_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel_generate(make_tiny_model("llama"), PROMPT, 8)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        run_workers(0, _misuse, "budget")


@pytest.mark.parametrize("args, option", [(["--workers", "0"], "--workers"),
                                          (["--workers", "2", "--temperature", "-1"], "--temperature"),
                                          (["--workers", "2", "--compare"], "--compare"),
                                          (["--tensor-parallel", "--dtype", "int8"], "keeps weights quantised")])
def test_bad_parallel_options_are_refused_before_loading_anything(args, option):
    result = run("generate", "hello", *args)
    assert result.returncode == 2 and option in result.stderr


def _greedy_reference(default_model, text: str, tokens: int) -> str:
    model, tokenizer = default_model
    ids = encode_prompt(tokenizer, text)
    return tokenizer.decode(reference_greedy(model, ids, tokens)[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_two_workers_on_the_default_model_equal_greedy_generate(default_model):
    question = "Write a Python function that reverses a string, with a docstring."
    result = run("generate", question, "--workers", "2", "--threads", "1", "--window", "9", "--ngram", "5",
                 "--guesses", "9", "--max-new-tokens", "64", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["workers"] == 2 and report["new_tokens"] == 64 and report["tokens_per_step"] > 1.0
    assert report["text"] == _greedy_reference(default_model, question, 64)


@pytest.mark.slow
def test_torchrun_launches_the_same_decoding(tiny_dir):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "lookahead", "generate", "One two three",
               "--model", tiny_dir, "--raw", "--window", "4", "--guesses", "4", "--max-new-tokens", "24", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["workers"] == 2  # rank 0 reports, once
    alone = run("generate", "One two three", "--model", tiny_dir, "--raw", "--window", "4", "--guesses", "4",
                "--max-new-tokens", "24", "--json")
    assert reports[0]["text"] == json.loads(alone.stdout)["text"] and reports[0]["steps"] == json.loads(alone.stdout)["steps"]


@pytest.mark.slow
def test_under_torchrun_a_refused_call_says_why_in_a_line_on_each_rank(tiny_dir, tmp_path):
    """What each rank's parallel_generate refuses (a generation config that beam-searches) ends that rank as one
    process ends: an `Error:` line and exit code 2, not a traceback per rank."""
    folder = tmp_path / "beams"
    shutil.copytree(tiny_dir, folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, "num_beams": 2}))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "lookahead", "generate", "One two three",
               "--model", str(folder), "--raw", "--window", "4", "--max-new-tokens", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert done.stderr.count("Error: the model's generation config sets num_beams=2") == 2, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr and "lookahead/parallel.py" not in done.stderr  # no traceback of ours


@pytest.mark.slow
def test_bench_parallel_compares_worker_counts_and_predicts_devices(tiny_dir, tmp_path):
    cost = tmp_path / "cost.json"  # a cost curve from elsewhere (a GPU, say): T(k) flat up to 64 rows
    cost.write_text(json.dumps({"points": [{"tokens": k, "seconds": 0.01 * max(1.0, k / 64)} for k in (1, 64, 128)]}))
    result = run("bench", "parallel", "--model", tiny_dir, "--workers", "1,2", "--window", "4", "--ngram", "3",
                 "--guesses", "4", "--limit", "2", "--max-new-tokens", "12", "--max-devices", "4",
                 "--cost-file", str(cost), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    one, two = results["runs"]
    assert (one["workers"], two["workers"]) == (1, 2) and two["identical"] is True
    assert one["steps"] == two["steps"] and one["new_tokens"] == two["new_tokens"] <= 24
    assert two["rows_per_step"] < one["rows_per_step"]  # each worker runs a share of the step
    speedups = [p["speedup"] for p in results["predictions"]]
    assert [p["devices"] for p in results["predictions"]] == [1, 2, 3, 4] and speedups == [1.0] * 4  # flat T(k)
    assert (tmp_path / "out" / "parallel.png").stat().st_size > 0
    bad = run("bench", "parallel", "--model", tiny_dir, "--workers", "2,4")
    assert bad.returncode == 2 and "starting with 1" in bad.stderr


@pytest.mark.slow
def test_generate_workers_samples_what_one_process_samples(tiny_dir):
    args = ["generate", "One two three", "--model", tiny_dir, "--raw", "--window", "4", "--guesses", "4",
            "--max-new-tokens", "24", "--temperature", "0.9", "--top-p", "0.9", "--seed", "5", "--json"]
    parallel, alone = run(*args, "--workers", "2", "--threads", "1"), run(*args)
    assert parallel.returncode == 0 and alone.returncode == 0, parallel.stderr + alone.stderr
    assert json.loads(parallel.stdout)["text"] == json.loads(alone.stdout)["text"]


@pytest.fixture(scope="module")
def shardable_dir(tmp_path_factory, default_model):
    """A tiny Llama whose 4 query and 2 key/value heads split over 2 processes, with the default model's
    tokenizer but only its first 256 ids (single characters), and peaked weights: its greedy text soon
    repeats, so that lookahead accepts guesses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import peaked

    _, tokenizer = default_model
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("shardable")
    peaked(LlamaForCausalLM(config), 0.15).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_lookahead_on_transformers_tensor_parallelism_equals_greedy_generate(shardable_dir):
    """torchrun, 2 processes, the weights split by transformers' tp_plan='auto': the automatic config
    (every process takes rank 0's cost curves, so that all plan the same steps) gives greedy's tokens."""
    from lookahead.models import load_model

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    text = "1 2 3 4 5 6 7"  # ids below 256
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "lookahead", "generate", text, "--model",
               shardable_dir, "--raw", "--max-new-tokens", "32", "--tensor-parallel", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1  # rank 0 reports
    model, tokenizer = load_model(shardable_dir)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    expected = reference_greedy(model, ids, 32)[0, ids.shape[1]:]
    assert reports[0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert reports[0]["new_tokens"] == expected.numel() and reports[0]["tokens_per_step"] > 1.0


def test_bench_parallel_refuses_prompts_past_the_context_before_any_worker_starts(tiny_dir):
    result = run("bench", "parallel", "--model", tiny_dir, "--workers", "1,2", "--limit", "1", "--max-new-tokens", "5000")
    assert result.returncode == 2 and "exceeds the model's context" in result.stderr
    assert "Traceback" not in result.stderr and "worker" not in result.stderr


def test_under_torchrun_one_process_options_and_a_prompt_from_stdin_are_refused_as_such(monkeypatch):
    """torchrun's processes, not --workers: the refusal says so; its standard input reaches one process alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    stop = run("generate", "hello", "--stop", "x")
    assert stop.returncode == 2 and "--stop runs in one process; not under torchrun" in stop.stderr
    piped = run("generate", "-")
    assert piped.returncode == 2 and "reaches one of torchrun's processes only" in piped.stderr


def test_tensor_parallel_needs_torchrun():
    result = run("generate", "hello", "--tensor-parallel")
    assert result.returncode == 2 and "--tensor-parallel" in result.stderr and "torchrun" in result.stderr


def test_a_one_column_window_loads_its_worker_with_each_of_its_levels():
    """W1 N3: worker 0 runs the column's 2 rows (load 2), worker 1 none (load 0). The 3-node chain (rows 3-5)
    goes to worker 1; the single node 10 (row 6) to worker 0 (2 against 3); 11 (row 7), on a tie at 3, to
    worker 0, the first."""
    tree = build_guess_tree([[20, 21, 22], [10], [11]])
    layout = step_layout(2, 1, tree)
    shares = split_step(layout, tree.parents, 2)
    assert [share.rows.tolist() for share in shares] == [[0, 1, 2, 6, 7], [0, 3, 4, 5]]
