"""`lookahead bench` and its subcommands, run as a user runs them, on a tiny model and the default model."""

from __future__ import annotations

import copy
import json
import math
import shutil
import time

import pytest
import torch
from conftest import reference_greedy
from conftest import run_cli as run

from lookahead.bench import batch
from lookahead.bench import serve as bench_serve
from lookahead.bench.report import divergence_table, summary_table, write_benchmark
from lookahead.bench.runner import Run, TieMeter, summarize
from lookahead.bench.serve import LoadRun, load_table
from lookahead.config import PLAIN_CONFIG
from lookahead.workloads import CODE_EDITS, _lines, load_workload


def check_results(folder, methods: set[str], prompts: int, turns: int = 1) -> dict:
    for name in ("results.json", "report.md", "speedup.png", "tokens_per_step.png"):
        assert (folder / name).stat().st_size > 0, name
    results = json.loads((folder / "results.json").read_text())
    runs = results["runs"]
    assert {r["method"] for r in runs} == methods
    assert len(runs) == len(methods) * prompts * turns
    for r in runs:
        assert 1 <= r["steps"] <= r["new_tokens"] and r["seconds"] > 0
        if r["tokens_fed"] is not None:  # ours: every step feeds at least the last token
            assert r["tokens_fed"] >= r["steps"]
        if r["method"] != "pld":  # ours and greedy itself: token-identical to greedy in fp32
            assert r["identical"] is True and r["first_difference"] is None
    for row in results["summary"]:
        if row["method"] in ("greedy", "plain") or row["method"].startswith("lookahead"):
            assert row["identical_rate"] == 1.0
        if row["method"] in ("greedy", "plain"):  # steps counted from the model's forward passes
            assert row["tokens_per_step"] == pytest.approx(1.0)
    assert results["environment"]["dtype"] == "float32"
    report = (folder / "report.md").read_text()
    assert all(method in report for method in methods)
    return results


def test_bench_on_a_tiny_model(tiny_dir, tmp_path):
    result = run("bench", "--model", tiny_dir, "--dataset", "mt_bench", "--limit", "2", "--max-new-tokens", "8",
                 "--config", "2,3,2", "--config", "0,4,3", "--config", "auto:0", "--out", str(tmp_path), "--profile")
    assert result.returncode == 0, result.stderr
    results = check_results(tmp_path, {"greedy", "pld", "plain", "lookahead-W2N3G2", "lookahead-W0N4G3",
                                       "lookahead-W0N4G5S32R4-budget"}, 2)
    assert "drafts lookahead-W0N4G5S32R4-budget: fed " in result.stdout  # auto:0: the automatic config, no window
    assert "window 0 columns" in next(line for line in result.stdout.splitlines()
                                      if line.startswith("drafts lookahead-W0N4G5S32R4-budget"))
    assert {r["category"] for r in results["runs"]} == {"writing", "roleplay"}  # the limit spans categories
    assert "profile lookahead-W2N3G2:" in result.stdout and "| lookahead-W0N4G3 | all |" in result.stdout
    assert "Every output was token-identical" in result.stdout
    assert "drafts lookahead-W2N3G2: fed " in result.stdout and "drafts lookahead-W0N4G3: fed " in result.stdout
    profile = next(line for line in result.stdout.splitlines() if line.startswith("profile lookahead-W2N3G2:"))
    assert all(f" {phase} " in profile for phase in ("forward", "inputs", "plan", "verify", "commit", "prefill"))
    # the shares add up to the whole call: "set-up" holds what no phase timed (they had summed to about 90%)
    shares = [share.rsplit(" ", 1) for share in profile.split("; ")[1].split(", ")]
    assert shares[-1][0] == "set-up"
    assert sum(float(share.rstrip("%")) for _, share in shares) == pytest.approx(100, abs=0.5)


def test_bench_two_turns_and_a_user_jsonl(tiny_dir, tmp_path):
    result = run("bench", "--model", tiny_dir, "--dataset", "mt_bench", "--turns", "2", "--limit", "1",
                 "--max-new-tokens", "6", "--baselines", "greedy", "--config", "3,3,3", "--out", str(tmp_path / "a"))
    assert result.returncode == 0, result.stderr
    results = check_results(tmp_path / "a", {"greedy", "lookahead-W3N3G3"}, 1, turns=2)
    assert sorted({r["turn"] for r in results["runs"]}) == [0, 1]
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "Say hi."}\n{"prompt": "Count to five.", "category": "count"}\n')
    result = run("bench", "--model", tiny_dir, "--dataset", str(data), "--max-new-tokens", "6",
                 "--baselines", "greedy,plain", "--out", str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    results = check_results(tmp_path / "b", {"greedy", "plain", "lookahead-auto", "lookahead-W5N4G5"}, 2)
    assert {r["category"] for r in results["runs"]} == {"mine", "count"}


def test_bench_sweep_and_cost(tiny_dir, tmp_path):
    result = run("bench", "sweep", "--model", tiny_dir, "--limit", "2", "--windows", "0,2", "--ngrams", "3",
                 "--guesses", "1,3", "--max-new-tokens", "8", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [(p["window"], p["guesses"]) for p in sweep["points"]] == [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert all(p["tokens_fed_per_step"] >= 1 and p["tokens_per_step"] >= 1 for p in sweep["points"])
    assert set(sweep["fit"]) == {"intercept", "slope"} and (tmp_path / "sweep.png").stat().st_size > 0
    assert "fit: tokens/step =" in result.stdout

    # one config three times: every point feeds the same tokens a step, so there is no slope to fit (numpy had made one)
    result = run("bench", "sweep", "--model", tiny_dir, "--limit", "1", "--windows", "3,3,3", "--ngrams", "3",
                 "--guesses", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "same"))
    assert result.returncode == 0, result.stderr
    assert "fit: none (the points feed the same number of tokens a step)" in result.stdout
    stored = (tmp_path / "same" / "sweep.json").read_text()
    assert "NaN" not in stored and json.loads(stored)["fit"] is None  # NaN is no JSON

    result = run("bench", "cost", "--model", tiny_dir, "--max-k", "8", "--repeats", "1", "--context", "16",
                 "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert [p["tokens"] for p in cost["points"]] == [1, 2, 4, 8]
    assert cost["points"][0]["relative"] == 1.0 and all(p["seconds"] > 0 for p in cost["points"])
    assert (tmp_path / "cost.png").stat().st_size > 0 and list(cost["curves"]) == ["eager"]
    assert cost["curves"]["eager"] == cost["points"]


def test_bench_corpus_on_a_tiny_model(tiny_dir):
    result = run("bench", "corpus", "--model", tiny_dir, "--limit", "2", "--max-new-tokens", "12", "--chars", "300")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]  # after the header
    assert len(rows) == 3 and rows[-1].startswith("| all |")
    assert all(row.rstrip(" |").endswith("True") for row in rows)  # the corpus never changes a greedy output


def test_bench_corpus_retry_drafts_the_second_reply_from_the_first(tiny_dir):
    result = run("bench", "corpus", "--model", tiny_dir, "--limit", "2", "--max-new-tokens", "24", "--chars", "300",
                 "--pair", "retry")
    assert result.returncode == 0, result.stderr
    cells = [line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith("| all |")][0]
    first, alone, shared = map(float, cells[1:4])
    assert shared > alone and cells[-1] == "True", result.stdout  # the same reply, drafted from the corpus


@pytest.fixture(scope="module")
def linear_attention_dir(tmp_path_factory, tiny_dir):
    """The tiny model with layers whose cache cannot roll back (as Mamba's or Qwen3-Next's linear attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.config.layer_types = ["linear_attention"] * model.config.num_hidden_layers
    folder = tmp_path_factory.mktemp("linear")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("command", [["bench"], ["bench", "--batch-size", "1"], ["bench", "sweep"], ["bench", "corpus"],
                                     ["bench", "cost"], ["bench", "serve"]])
def test_every_bench_command_refuses_a_model_lookahead_cannot_run_in_a_line(linear_attention_dir, command):
    """`generate` and `serve` said so in a line (exit 2); the bench commands had ended in a traceback."""
    result = run(*command, "--model", linear_attention_dir, "--max-new-tokens" if command[-1] != "cost" else "--max-k",
                 "2")
    assert result.returncode == 2 and "Error: LlamaForCausalLM has layers of type ['linear_attention']" in result.stderr


@pytest.mark.parametrize("command", [["bench"], ["bench", "--batch-size", "1"], ["bench", "sweep"], ["bench", "corpus"]])
def test_bench_commands_refuse_prompts_past_the_context_before_any_run(tiny_dir, command, monkeypatch):
    """A benchmark had run transformers' baseline on the first prompt, then failed on ours with a traceback."""
    from transformers.generation.utils import GenerationMixin

    monkeypatch.setattr(GenerationMixin, "generate", lambda *args, **kwargs: pytest.fail("a baseline ran"))
    result = run(*command, "--model", tiny_dir, "--limit", "1", "--max-new-tokens", "5000")
    assert result.returncode == 2 and "exceeds the model's context of 2048 positions" in result.stderr, result.stderr


def test_what_only_a_bench_run_finds_ends_it_in_a_line(tiny_dir):
    """A sample of scores a temperature of 1e-45 overflows (or a second turn past the context) had ended the
    benchmark in a traceback."""
    result = run("bench", "--model", tiny_dir, "--sample", "--temperature", "1e-45", "--limit", "1", "--baselines", "",
                 "--config", "2,2,2", "--max-new-tokens", "4")
    assert result.returncode == 2 and "Error: sampling: the processed scores are not finite" in result.stderr


def test_bench_cost_refuses_packed_linears_where_there_are_none_by_the_option(tiny_dir):
    result = run("bench", "cost", "--model", tiny_dir, "--dtype", "float16", "--packed-linear", "--max-k", "2")
    assert result.returncode == 2 and "--packed-linear" in result.stderr and "packed_linear=True needs" in result.stderr


def test_bench_serve_refuses_a_model_without_a_chat_template_before_any_request(tmp_path, tiny_dir):
    """Its clients chat: every request had been refused (400), after the warm-up and every round."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = None
    shutil.copytree(tiny_dir, tmp_path / "model")
    for template in (tmp_path / "model").glob("chat_template.*"):
        template.unlink()
    tokenizer.save_pretrained(tmp_path / "model")
    result = run("bench", "serve", "--model", str(tmp_path / "model"), "--clients", "1", "--requests", "1",
                 "--max-new-tokens", "2", "--rounds", "1")
    assert result.returncode == 2 and "--model" in result.stderr and "no chat template" in result.stderr


def test_the_command_a_report_records_runs_again_as_given(tiny_dir, tmp_path, monkeypatch):
    """An argument with a space, or an empty one, lost its quoting in the recorded command."""
    import shlex
    import sys

    prompts = tmp_path / "my prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Say hi."]}) + "\n")
    argv = ["lookahead", "bench", "--model", tiny_dir, "--dataset", str(prompts), "--baselines", "", "--config",
            "2,2,2", "--max-new-tokens", "4", "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    result = run(*argv[1:])
    assert result.returncode == 0, result.stderr
    command = json.loads((tmp_path / "out" / "results.json").read_text())["command"]
    assert shlex.split(command) == argv


def test_bench_corpus_refuses_an_unknown_pair(tiny_dir):
    result = run("bench", "corpus", "--model", tiny_dir, "--pair", "twice")
    assert result.returncode == 2 and "--pair" in result.stderr and "summaries, retry" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "nope"], "dataset must be one of"),
        (["--dataset", "prompts/missing.jsonl"], "or a JSONL file, got 'prompts/missing.jsonl': no such file"),
        (["--config", "1,2"], "expected W,N,G"),
        (["--config", "auto:x"], "expected auto:W with W an integer >= 0"),
        (["--config", "auto:60"], "window x (ngram - 1) must be below 128"),
        (["--config", "50,4,5"], "window x (ngram - 1) must be below 128"),
        (["--config", "auto", "--config", "auto:5"], "each method once: lookahead-auto given twice"),
        (["--config", "1,1,1"], "ngram must be an integer >= 2"),
        # a digit to str.isdigit, not to int(): it had ended in a traceback
        (["--config", "2,4,\u00b2"], "expected W,N,G (three integers)"),
        (["--config", "auto:\u00b2"], "expected auto:W with W an integer >= 0"),
        (["--baselines", "greedy,beam"], "unknown ['beam']"),
        (["--dataset", "mt_bench", "--category", "poetry"], "'poetry' is not in mt_bench"),
        (["--config", "1,2,1", "--config", "1,2,1"], "each method once: lookahead-W1N2G1 given twice"),
        (["--turns", "2", "--raw"], "a second turn needs the chat template"),
        (["--model", "/nowhere", "--dtype", "bfloat16", "cost"], "--model, --dtype"),
        (["serve", "--url", "http://127.0.0.1:9", "--model", "/nowhere", "--max-batch", "2"], "--model, --max-batch"),
        (["serve", "--served-model", "x", "--api-key", "k"], "--served-model, --api-key"),
        (["serve", "--clients", "64"], "mt_bench has 80 prompts, fewer than the 128 requests"),
        (["parallel", "--cost-file", "pyproject.toml"], "not a cost.json of `lookahead bench cost`"),
        (["serve", "--url", "foo"], "expected the server's address, http://HOST:PORT, got 'foo'"),
        (["sweep", "--windows", ""], "expected at least one value"),
        (["sweep", "--windows", "1,-1"], "Invalid value for --windows: must be an integer >= 0"),
        (["sweep", "--windows", "50", "--ngrams", "4"], "the window of 50 x 3 rows is too large for one step"),
        (["--out", "pyproject.toml"], "cannot write into the folder pyproject.toml"),
        (["cost", "--out", "pyproject.toml/x"], "cannot write into the folder"),
    ],
)
def test_bench_bad_options(args, message):
    """Refused before any model loads (a model path that does not exist would fail otherwise)."""
    result = run("bench", *args)
    assert result.returncode == 2
    assert message in " ".join(result.stderr.split())  # the console wraps long messages


@pytest.mark.slow
def test_bench_on_the_default_model(tmp_path):
    result = run("bench", "--dataset", "code_edit", "--limit", "2", "--max-new-tokens", "16", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    results = check_results(tmp_path, {"greedy", "pld", "plain", "lookahead-auto", "lookahead-W5N4G5"}, 2)
    assert {r["category"] for r in results["runs"]} == {"comments", "type_checks"}


def test_code_edits_hold_the_code_they_edit():
    """Each code edit's prompt holds a HumanEval function with its solution, and asks one of the edits in turn."""
    solved = {row["task_id"].split("/")[1]: row["prompt"] + row["canonical_solution"] for row in _lines("humaneval")}
    edits = load_workload("code_edit")
    assert len(edits) == len(solved) == 164 and len({e.id for e in edits}) == 164
    for index, edit in enumerate(edits):
        assert f"```python\n{solved[edit.id.split('/')[1]]}```" in edit.turns[0]
        assert edit.category == list(CODE_EDITS)[index % 3] and edit.turns[0].startswith(CODE_EDITS[edit.category])


def test_bench_with_sampling(tiny_dir, tmp_path):
    result = run("bench", "--model", tiny_dir, "--dataset", "mt_bench", "--limit", "2", "--max-new-tokens", "8",
                 "--sample", "--temperature", "0.8", "--top-k", "20", "--config", "2,3,2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in results["runs"]} == {"sample", "pld", "plain", "lookahead-W2N3G2"}
    assert all(r["identical"] is None for r in results["runs"])  # samples are not compared token for token
    assert all(1 <= r["steps"] <= r["new_tokens"] <= 8 for r in results["runs"])
    assert "temperature=0.8" in results["environment"]["sampling"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tie_meter_measures_the_gap_between_the_two_choices(llama_tiny, dtype):
    """At a divergence the report gives |logit(greedy's token) - logit(ours)|, from a float32 forward of
    the model's own weights whatever the model's dtype."""
    model = copy.deepcopy(llama_tiny).to(dtype)
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    reference = reference_greedy(llama_tiny, prompt, 10)[0, 12:].tolist()
    ours = list(reference)
    ours[4] = (reference[4] + 1) % 128
    gap, median_gap, spacing = TieMeter(model).gaps(prompt, reference, ours, 4)
    with torch.inference_mode():
        full = copy.deepcopy(model).float()(torch.cat([prompt[0], torch.tensor(reference[:4])]).view(1, -1)).logits[0, -1]
    assert gap == pytest.approx(abs(float(full[reference[4]] - full[ours[4]])), rel=1e-4, abs=1e-5)
    assert median_gap > 0
    magnitude = 2.0 ** math.floor(math.log2(abs(float(full[reference[4]]))))
    assert spacing == pytest.approx(torch.finfo(dtype).eps * magnitude)


def test_report_lists_every_divergence():
    runs = [
        Run("a", "c", 0, "plain", 8, 8, 1.0, 0.9, 8, True, None),
        Run("b", "c", 0, "plain", 8, 8, 1.0, 0.9, 8, False, 5, 0.0625, 2.5, 0.125),
    ]
    table = divergence_table(runs)
    assert "1 of 2 outputs differ" in table and "| plain | b | 0 | 5 | 0.062 | 0.1250 | 2.500 |" in table
    greedy = [Run(p, "c", 0, "greedy", 8, 8, 1.0, None, None, True, None) for p in "ab"]
    assert "1 of 2 outputs differ" in divergence_table(runs + greedy)  # `generate` is not compared with itself
    assert "token-identical" in divergence_table(runs[:1])
    sampled = [Run("a", "c", 0, "plain", 8, 8, 1.0, 0.9, 8, None, None)]
    assert "not compared" in divergence_table(sampled)


def test_bench_batch_sizes_on_a_tiny_model(tiny_dir, tmp_path):
    result = run("bench", "--model", tiny_dir, "--batch-size", "1,3", "--limit", "4", "--max-new-tokens", "8",
                 "--config", "2,3,2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["batch_size"], r["method"]) for r in runs] == [
        (b, m) for b in (1, 3) for m in ("transformers", "plain", "lookahead")]
    for r in runs:  # two rounds (the default) of the 4 prompts
        assert r["sequences"] == 8 and 8 <= r["new_tokens"] <= 64 and r["seconds"] > 0 and r["latency"] > 0
        if r["method"] == "lookahead":
            assert r["identical"] is True  # the same tokens as the plain engine
        if r["method"] == "plain":  # one token per step of each sequence
            assert r["tokens_per_step"] == pytest.approx(1.0)
    assert (tmp_path / "batch.png").stat().st_size > 0 and "| 3 | lookahead |" in (tmp_path / "report.md").read_text()
    bad = run("bench", "--model", tiny_dir, "--batch-size", "0,2")
    assert bad.returncode == 2 and "--batch-size" in bad.stderr
    bad = run("bench", "--model", tiny_dir, "--batch-size", "1,4", "--limit", "2")  # had run, 2 sequences labelled 4
    assert bad.returncode == 2 and "batch size 4 needs as many prompts; the workload gives 2" in bad.stderr
    for args in (["--batch-size", "2", "--rounds", "0"], ["--rounds", "3"]):
        bad = run("bench", "--model", tiny_dir, *args)
        assert bad.returncode == 2 and "--rounds" in bad.stderr


def test_batch_rounds_alternate_the_order_of_the_methods(monkeypatch):
    """The machine drifts: each round runs the methods in the reverse order of the one before."""
    calls = []

    def transformers_batch(model, prompts, max_new_tokens):
        calls.append("transformers" if max_new_tokens == 4 else f"transformers warm-up, {len(prompts)} prompts")
        return [[1, 2]] * len(prompts), 1.0, [1.0] * len(prompts)

    def engine(model, prompts, max_new_tokens, config, size, compile):
        calls.append("plain" if config is PLAIN_CONFIG else "lookahead")
        return [[1, 2]] * len(prompts), 2.0, [2.0] * len(prompts), 2 * len(prompts)

    class NoEngine:
        def __init__(self, *args, **kwargs):
            pass

        def warm_up(self):
            pass

    monkeypatch.setattr(batch, "_transformers_batch", transformers_batch)
    monkeypatch.setattr(batch, "_engine", engine)
    monkeypatch.setattr(batch, "Engine", NoEngine)
    runs = batch.batch_runs(None, [torch.tensor([1, 2, 3])] * 3, [2], 4, rounds=3)
    forward = ["transformers", "transformers", "plain", "lookahead"]  # transformers: 2 batches of at most 2
    assert calls == ["transformers warm-up, 2 prompts"] + forward + forward[::-1] + forward  # warm before timing
    by = {r.method: r for r in runs}
    assert by["plain"].sequences == 9 and by["plain"].new_tokens == 18 and by["plain"].seconds == 6.0
    assert by["transformers"].seconds == 6.0  # 2 batches of the 3 prompts a round
    with pytest.raises(ValueError, match="rounds"):
        batch.batch_runs(None, [torch.tensor([1])], [1], 4, rounds=0)


def test_bench_serve_loads_a_server_with_lookahead_on_and_off(tiny_dir, tmp_path):
    result = run("bench", "serve", "--model", tiny_dir, "--clients", "3", "--requests", "5", "--max-new-tokens", "8",
                 "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    runs = {r["mode"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert set(runs) == {"off", "auto"}
    for r in runs.values():  # two rounds (the default) of 5 requests
        assert (r["clients"], r["requests"], r["failed"]) == (3, 10, 0)
        assert 10 <= r["tokens"] <= 80 and r["seconds"] > 0 and r["tokens_per_second"] > 0
        assert 0 < r["first_token_p50"] <= r["first_token_p99"] and 0 <= r["inter_token_p50"] <= r["inter_token_p99"]
    assert runs["off"]["tokens_per_step"] == pytest.approx(1.0)  # one token per step with lookahead off
    assert runs["auto"]["identical"] == 10  # greedy: every reply as with lookahead off
    assert (tmp_path / "serve.png").stat().st_size > 0 and "| auto | 3 | 10 | 0 |" in (tmp_path / "report.md").read_text()


def test_serve_rounds_alternate_the_modes_each_run_with_a_key_of_its_own(monkeypatch):
    calls = []

    def load_run(url, model, prompts, clients, max_tokens, mode, api_key, time_limit):
        calls.append((mode, api_key, len(prompts)))
        results = [bench_serve.StreamResult(i, text=f"reply {i}", tokens=4, steps=2 if mode == "auto" else 4,
                                            first_token=0.1, gaps=[0.01] * 3) for i in range(len(prompts))]
        return bench_serve._summary(mode, clients, results, 2.0), results

    monkeypatch.setattr(bench_serve, "load_run", load_run)
    keys = ("k0", "k1", "k2", "k3")
    off, auto = bench_serve.serve_load("url", "m", ["a", "b", "c"], 2, 4, keys, rounds=2)
    measured = [(mode, key) for mode, key, count in calls if count == 3]  # the warm-ups send 2 x clients
    assert measured == [("auto", "k0"), ("off", "k1"), ("off", "k3"), ("auto", "k2")]
    assert all(key == measured[i][1] for i, (_, key, count) in enumerate(c for c in calls if c[2] == 4))
    assert (auto.requests, auto.tokens, auto.steps, auto.seconds, auto.identical) == (6, 24, 12, 4.0, 6)
    assert (off.requests, off.steps, off.identical) == (6, 24, None)
    with pytest.raises(ValueError, match="rounds"):
        bench_serve.serve_load("url", "m", ["a"], 1, 4, rounds=0)


@pytest.mark.parametrize("content, message", [
    ("5\n", "each line must be an object"),
    ('"my prompt"\n', "each line must be an object"),
    ('{"prompt": 123}\n', "'prompt' must be a non-empty string"),
    ('{"turns": []}\n', "'turns' must be a non-empty list of non-empty strings"),
    ('{"turns": "hello world"}\n', "'turns' must be a non-empty list"),  # had run on the prompt "h"
    ("\n", "holds no prompt"),
    ("{oops\n", "not JSON"),
    ('{"prompt": "a", "id": "q"}\n{"prompt": "b", "id": "q"}\n', "prompts.jsonl:2: id 'q' is line 1's too"),
    ('{"prompt": "a", "id": "1"}\n{"prompt": "b"}\n', "id '1' is line 1's too"),  # the second's index
    ('{"prompt": "a", "category": "all"}\n', "the category 'all' names the row of every prompt"),
    (b'{"prompt": "caf\xe9"}\n', "prompts.jsonl: cannot be read as UTF-8 text"),  # Latin-1: had not named the file
])
def test_a_jsonl_dataset_that_is_not_one_prompt_object_a_line_is_refused(tmp_path, content, message):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run("bench", "--dataset", str(dataset), "--model", "/nowhere")
    assert result.returncode == 2 and "--dataset" in result.stderr and message in " ".join(result.stderr.split())


def test_raw_prompts_of_every_built_in_workload_skip_the_chat_template():
    """`--raw` had reached HumanEval alone: the others went through the chat template all the same."""
    from lookahead.workloads import BUILTIN, load_workload

    for name in BUILTIN:
        assert all(p.raw for p in load_workload(name, raw=True)) and not any(p.raw for p in load_workload(name))


def test_bench_serve_fails_when_requests_fail_and_says_why(tiny_dir):
    """Every request failing (here: a model the server does not serve) had printed a table of zeros and exited 0."""
    from lookahead.serve import create_app, serve_in_thread
    from lookahead.models import load_model

    model, tokenizer = load_model(tiny_dir)
    with serve_in_thread(create_app(model, tokenizer, model_name="tiny", max_batch=1, max_length=64)) as url:
        result = run("bench", "serve", "--url", url, "--served-model", "other", "--clients", "1", "--requests", "1",
                     "--max-new-tokens", "2")
    assert result.returncode == 2
    assert "off: 1 of 1 requests failed (HTTP 404" in result.stderr and "model_not_found" in result.stderr


def test_bench_cost_names_max_k_past_the_models_context(tiny_dir):
    result = run("bench", "cost", "--model", tiny_dir, "--max-k", "4096", "--repeats", "1")
    assert result.returncode == 2 and "--max-k" in result.stderr and "exceeds the model's context" in result.stderr


def test_bench_serve_names_a_server_it_cannot_reach_or_that_refuses(tiny_dir):
    """Said plainly: "cannot reach .../v1/models: [Errno 111] Connection refused" where the repr of urllib's
    error had been printed; a server wanting a key says so."""
    from lookahead.models import load_model
    from lookahead.serve import create_app, serve_in_thread

    result = run("bench", "serve", "--url", "http://127.0.0.1:9", "--requests", "1")
    assert result.returncode == 2 and "--url" in result.stderr and "URLError" not in result.stderr
    assert "cannot reach http://127.0.0.1:9/v1/models: [Errno 111] Connection refused" in result.stderr
    model, tokenizer = load_model(tiny_dir)
    with serve_in_thread(create_app(model, tokenizer, model_name="tiny", max_length=64, api_keys=("k",))) as url:
        refused = run("bench", "serve", "--url", url, "--requests", "1")
        accepted = run("bench", "serve", "--url", url, "--api-key", "k", "--requests", "1", "--clients", "1",
                       "--max-new-tokens", "2")
    assert refused.returncode == 2 and "answered HTTP 401 Unauthorized (give a key it accepts: --api-key)" in refused.stderr
    assert accepted.returncode == 0, accepted.stderr
    result = run("bench", "serve", "--url", "http://127.0.0.1:9", "--rounds", "2")
    assert result.returncode == 2 and "--rounds" in result.stderr and "same key" in result.stderr


@pytest.mark.slow  # 20-70 s of a subprocess: the full tier's
def test_the_gpu_check_runs_through_on_tiny_shapes(tmp_path):
    """scripts/gpu_check.sh runs only when a GPU is lent, rarely: its dry run keeps it from rotting. On a
    CPU it checks exactness and measures both eager cost curves; the CUDA-graph mode is skipped there."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--device", "cpu"], cwd=root, timeout=300,
                          capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(report["exactness"]) == 6 and all(row["identical"] for row in report["exactness"])
    curves = report["cost_curves"][0]
    for mode in ("ours_eager", "hf_static_eager"):
        assert sorted(map(int, curves[mode])) == [1, 2, 4, 8, 16, 32, 64, 128] and min(curves[mode].values()) > 0
    assert curves["hf_static_cuda_graphs"] == curves["ours_compiled"] == "skipped: CUDA only"
    assert {row["mode"] for row in report["projections"]} == {"ours_eager", "hf_static_eager"}
    assert (tmp_path / "gpu_check.txt").stat().st_size > 0


def _gpu_check_script():
    """scripts/gpu_check.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).resolve().parent.parent / "scripts" /
                                                  "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_starts_no_mode_without_the_time_it_needs():
    """A mode of the cost curves starts only with the time it may need left before the budget's end (a compile
    begun late was killed by the script's timeout, losing what came before); each measured mode is saved at once."""
    check = _gpu_check_script()
    saved: list[list[str]] = []

    def save(rows):
        saved.append([mode for mode, value in rows[0].items() if isinstance(value, dict)])

    shapes = [("tiny", torch.float32)]
    late = check.cost_curves("cpu", shapes, False, time.time() + min(check.NEEDS.values()) - 1, save)
    assert late[0]["ours_eager"] == late[0]["hf_static_eager"] == "skipped: time budget spent" and saved == []
    ample = check.cost_curves("cpu", shapes, False, time.time() + 600, save)
    assert saved == [["ours_eager"], ["ours_eager", "hf_static_eager"]]  # saved after each mode
    assert sorted(map(int, ample[0]["hf_static_eager"])) == list(check.SIZES)


def test_compiled_methods_are_compared_with_compiled_plain_and_reports_name_their_baseline():
    runs = [Run("a", "c", 0, method, 8, steps, seconds, None, 8, None, None)
            for method, steps, seconds in [("sample", 8, 8.0), ("plain", 8, 4.0), ("lookahead-auto", 4, 2.0),
                                           ("plain-compiled", 8, 2.0), ("lookahead-auto-compiled", 4, 1.0)]]
    rows = {r.method: r for r in summarize(runs, baseline="sample") if r.category == "all"}
    assert rows["lookahead-auto"].speedup_vs_plain == pytest.approx(2.0)
    assert rows["lookahead-auto-compiled"].speedup_vs_plain == pytest.approx(2.0)  # not 4x: compiled plain took 2 s
    assert rows["lookahead-auto-compiled"].speedup_total == pytest.approx(8.0)
    assert "speedup vs sample (total)" in summary_table(list(rows.values()), "sample")


def test_speedups_compare_times_per_new_token_where_outputs_end_apart():
    """Samples end at different lengths: a method whose output ended sooner is no faster for it."""
    runs = [Run(prompt, "c", 0, method, tokens, tokens, seconds, None, tokens, None, None)
            for prompt, method, tokens, seconds in [("a", "sample", 20, 20.0), ("a", "lookahead-auto", 40, 20.0),
                                                    ("b", "sample", 10, 10.0), ("b", "lookahead-auto", 5, 10.0)]]
    row = next(r for r in summarize(runs, baseline="sample") if r.method == "lookahead-auto" and r.category == "all")
    assert row.speedup_total == pytest.approx((30 / 30) / (30 / 45))  # 1 s a token against 0.67: not 30 s / 30 s
    assert row.speedup_geomean == pytest.approx((2.0 * 0.5) ** 0.5)  # 2x on a, 0.5x on b


def test_the_speedup_plot_is_left_out_without_a_baseline(tmp_path):
    runs = [Run("a", "c", 0, method, 8, steps, 2.0, None, 8, None, None) for method, steps in [("plain", 8), ("x", 4)]]
    written = write_benchmark(tmp_path, runs, summarize(runs), {}, "cmd")
    assert not (tmp_path / "speedup.png").exists() and tmp_path / "speedup.png" not in written
    assert "speedup.png" not in (tmp_path / "report.md").read_text() and (tmp_path / "tokens_per_step.png").exists()


def test_the_load_table_says_when_every_request_without_lookahead_failed():
    failed = LoadRun("off", 2, 4, 4, 1.0, 0, 0, *[float("nan")] * 4)
    worked = LoadRun("auto", 2, 4, 0, 1.0, 40, 20, 0.1, 0.2, 0.01, 0.02)
    table = load_table([failed, worked])
    assert "| off | 2 | 4 | 4 | 0.0 | – |" in table and "| auto | 2 | 4 | 0 | 40.0 | – |" in table


def test_the_bench_decodes_greedily_whatever_the_models_generation_config_asks_for():
    """`generate` samples where the model's generation config says do_sample=True; the bench's greedy runs of
    ours must not, or they would differ from the greedy baselines they are compared with."""
    from conftest import make_tiny_model

    from lookahead import LookaheadConfig
    from lookahead.bench.runner import Method, run_method

    model = make_tiny_model("llama")
    model.generation_config.do_sample = True
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    expected = reference_greedy(make_tiny_model("llama"), prompt, 12, eos_token_id=[])[0, prompt.shape[1]:].tolist()
    model.generation_config.eos_token_id = []
    for method in (Method("plain", "plain"), Method("lookahead", "lookahead", LookaheadConfig(3, 3, 3))):
        assert run_method(model, method, prompt, 12)[0] == expected, method


def test_the_bench_times_our_whole_call_as_it_times_transformers(monkeypatch):
    """transformers' `generate` is timed as a whole call; ours is too (its engine's set-up included), not from
    where our own statistics start counting."""
    from conftest import make_tiny_model

    import types

    import lookahead.bench.runner
    import lookahead.generation
    from lookahead.bench.runner import Method, run_method

    setting_up = [0.0]  # the bench's clock, moved on by an hour while the engine is set up
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + setting_up[0])

    class SlowToSetUp(lookahead.generation.Engine):
        def __init__(self, *args, **kwargs) -> None:
            setting_up[0] += 3600.0
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lookahead.bench.runner, "time", clock)
    monkeypatch.setattr(lookahead.generation, "Engine", SlowToSetUp)
    seconds = run_method(make_tiny_model("llama"), Method("plain", "plain"), torch.tensor([[5, 6, 7, 8]]), 4)[2]
    assert seconds >= 3600.0


def test_the_gpu_check_names_every_failure_it_records():
    """A mode that failed inside the cost curves, or an output that parted from generate's, had left the check's
    exit status 0: only a whole part that raised counted."""
    gpu_check = _gpu_check_script()
    clean = {"exactness": [{"shape": "tiny", "prompt": 0, "config": "auto", "identical": True}],
             "cost_curves": [{"shape": "tiny", "dtype": "float32", "ours_eager": {"1": 0.1},
                              "hf_static_cuda_graphs": "skipped: CUDA only"}]}
    assert gpu_check.problems(clean) == []
    broken = {"exactness": [{"shape": "tiny", "prompt": 2, "config": "W5N4G5", "identical": False}],
              "cost_curves": [{"shape": "tiny", "dtype": "float32", "hf_static_eager": "failed: RuntimeError: x"}]}
    assert gpu_check.problems(broken) == ["exactness tiny prompt 2 W5N4G5 diverged", "cost_curves tiny hf_static_eager"]
    assert gpu_check.problems({"exactness": "failed: Traceback", "cost_curves": "skipped: time budget spent"}) == [
        "exactness"]


def test_the_gpu_check_records_cuda_graphs_inductor_skipped(monkeypatch):
    """The CUDA-graph mode's times are CUDA graphs' only where inductor captured them: it records the graphs it ran
    without (torch's own count; a forward compiled here bumps it once, as a graph with a CPU node does)."""
    from torch._dynamo.utils import counters

    check = _gpu_check_script()
    model = check.build("tiny", torch.float32, "cpu")

    def compiled(forward, **options):
        assert options["mode"] == "reduce-overhead"

        def run(**inputs):
            if not calls:
                counters["inductor"]["cudagraph_skips"] += 1
            calls.append(1)
            return forward(**inputs)
        return run

    calls: list[int] = []
    monkeypatch.setattr(check, "SIZES", (1, 2))
    monkeypatch.setattr(check.torch, "compile", compiled)
    seconds = check.static_costs(model, "cpu", True, 1)
    assert seconds["cudagraph_skips"] == 1 and seconds[1] > 0 and seconds[2] > 0 and calls
    assert "cudagraph_skips" not in check.static_costs(model, "cpu", False, 1)
