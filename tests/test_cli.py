"""The `lookahead` command: in-process through its own parser (conftest.run_cli), and once as the
installed script in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import reference_greedy, run_cli

from lookahead.prompts import encode_prompt

LOOKAHEAD = str(Path(sys.executable).with_name("lookahead"))


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LOOKAHEAD, *args], capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt, options",
    [
        ("Give me three tips for staying focused while studying.", ["--window", "0", "--suffix", "16"]),
        ("Write a Python function that returns the n-th Fibonacci number.", []),  # the automatic config
    ],
)
def test_generate_compare_json(default_model, prompt, options):
    result = run_cli("generate", prompt, *options, "--compare", "--json", "--max-new-tokens", "96")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    model, tokenizer = default_model
    input_ids = encode_prompt(tokenizer, prompt)
    expected = reference_greedy(model, input_ids, 96)[0, input_ids.shape[1]:]
    assert report["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert report["new_tokens"] == expected.numel()
    assert report["identical"] is True
    if options:  # a fixed config feeds every draft, and some are accepted
        assert 1 <= report["steps"] < report["new_tokens"]
    else:  # the automatic one feeds drafts only where this machine's cost curve says they pay
        assert 1 <= report["steps"] <= report["new_tokens"]
    assert report["baseline_seconds"] > 0 and report["seconds"] > 0


def test_generate_stop_ends_the_reply_as_model_generate_does(default_model):
    prompt = ("Repeat this text exactly, twice: The small coastal town was abuzz with laughter, and the smell of "
              "saltwater filled the evening air as the fishing boats came home.")
    result = run_cli("generate", prompt, "--stop", "fishing bo", "--stop", "zebra qq", "--compare", "--json",
                     "--max-new-tokens", "48")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] is True  # model.generate got the same stop strings
    assert report["text"].endswith("the fishing boats") and report["new_tokens"] < 48  # the token with "bo" kept


def _tiny_with(tiny_dir: str, tmp_path: Path, **settings) -> str:
    """A copy of the tiny model whose generation config sets `settings`."""
    import shutil

    from transformers import GenerationConfig
    folder = shutil.copytree(tiny_dir, tmp_path / "tiny")
    config = GenerationConfig.from_pretrained(folder)
    for name, value in settings.items():
        setattr(config, name, value)
    config.save_pretrained(folder)
    return str(folder)


def test_generate_without_a_length_stops_where_the_models_context_ends(tiny_dir, tmp_path):
    """The default of 128 new tokens had been refused after a prompt that leaves fewer: it takes what is left."""
    import shutil

    folder = shutil.copytree(tiny_dir, tmp_path / "short")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 80}))
    result = run_cli("generate", "Write a long story.", "--model", str(folder), "--json", "--compare")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = encode_prompt(AutoTokenizer.from_pretrained(folder), "Write a long story.")
    expected = reference_greedy(AutoModelForCausalLM.from_pretrained(folder).eval(), prompt, 80 - prompt.shape[1])
    assert report["identical"] is True and report["new_tokens"] == expected.shape[1] - prompt.shape[1]


def test_generate_without_a_length_takes_the_generation_configs(tiny_dir, tmp_path):
    # the help says so (square brackets in it had been read as markup, and the default dropped from it)
    words = [word for word in run_cli("generate", "--help").stdout.split() if word != "│"]  # rich's box, where it wraps
    assert "else 128 or what the model's context leaves after the prompt" in " ".join(words)
    result = run_cli("generate", "Write a long story.", "--model", _tiny_with(tiny_dir, tmp_path, max_new_tokens=5),
                     "--json", "--compare")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] is True and 0 < report["new_tokens"] <= 5
    # ours timed as the baseline is, the whole call (its engine made, its request checked): stats.seconds, decoding
    # alone, had made the speedup
    assert report["call_seconds"] >= report["seconds"] > 0
    assert report["speedup"] == pytest.approx(report["baseline_seconds"] / report["call_seconds"])


def test_compare_says_whether_greedy_outputs_are_identical_and_that_samples_are_not_compared(tiny_dir):
    args = ["generate", "hi", "--model", tiny_dir, "--max-new-tokens", "4", "--compare"]
    greedy, sampled = run_cli(*args), run_cli(*args, "--temperature", "0.8", "--seed", "1")
    assert greedy.returncode == 0 and sampled.returncode == 0, greedy.stderr + sampled.stderr
    assert "identical: True]" in greedy.stderr
    assert "identical: not compared (sampled)]" in sampled.stderr
    # the reply shown once: transformers' run streams it too (each timed call pays the streamer), unshown
    text = json.loads(run_cli(*args, "--json").stdout)["text"]
    assert greedy.stdout.strip() == text.strip()


def test_generate_runs_a_model_whose_generation_config_has_stop_strings(tiny_dir, tmp_path):
    """generate reads the model's stop strings, which need the tokenizer: the CLI always passes it."""
    folder = _tiny_with(tiny_dir, tmp_path, stop_strings=["\n\n"])
    result = run_cli("generate", "hi", "--model", folder, "--max-new-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["new_tokens"] >= 1


def test_compare_gives_the_generation_configs_stop_strings_to_both_methods(tiny_dir, tmp_path):
    """Without --stop, transformers' generate was handed stop_strings=None, which sets none over the model's: it ran
    on past the string where ours stopped, and --compare said the greedy outputs differed."""
    free = json.loads(run_cli("generate", "hi", "--model", tiny_dir, "--max-new-tokens", "12", "--json").stdout)["text"]
    folder = _tiny_with(tiny_dir, tmp_path, stop_strings=[free[len(free) // 3:][:3]])
    result = run_cli("generate", "hi", "--model", folder, "--max-new-tokens", "12", "--json", "--compare")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] is True and report["new_tokens"] < 12


def test_generate_reports_what_decoding_refuses_in_one_line(tiny_dir, tmp_path):
    """A generation config asking for beam search is found only when decoding starts: one line and exit 2 (it
    had been a traceback and exit 1)."""
    result = run_cli("generate", "hi", "--model", _tiny_with(tiny_dir, tmp_path, num_beams=2), "--max-new-tokens", "4")
    assert result.returncode == 2 and "Error: " in result.stderr and "num_beams=2" in result.stderr
    assert "Traceback" not in result.stderr


def test_workers_refuse_a_model_whose_generation_config_has_stop_strings(tiny_dir, tmp_path):
    """One process stops at the model's stop strings; the workers would not: refused, not a different output."""
    folder = _tiny_with(tiny_dir, tmp_path, stop_strings=["\n\n"])
    result = run_cli("generate", "hi", "--model", folder, "--max-new-tokens", "4", "--workers", "2")
    assert result.returncode == 2 and "stop_strings" in result.stderr and "one process" in result.stderr


def test_a_seed_without_sampling_is_refused():
    result = run_cli("generate", "hi", "--seed", "3")
    assert result.returncode == 2 and "--seed" in result.stderr and "--temperature > 0" in result.stderr


def test_generate_refuses_an_empty_stop_string():
    result = run_cli("generate", "hi", "--stop", "")
    assert result.returncode == 2 and "--stop" in result.stderr and "must not be empty" in result.stderr


@pytest.mark.slow
def test_installed_script_streams_the_text_and_says_its_speed_on_stderr():
    # One thread, as each test worker runs: the script then reads the cost curve the workers measured (the
    # linear path is chosen by it) rather than measuring its own on two threads while they load the cores.
    result = run_script("generate", "def add(a, b):", "--raw", "--max-new-tokens", "24", "--window", "3", "--ngram", "3",
                        "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "[24 new tokens," not in result.stdout  # the reply alone, for a pipe
    summary = result.stderr.rstrip().rsplit("\n", 1)[-1]
    assert summary.startswith("[24 new tokens,") and "tokens/step" in summary and "tokens/s" in summary


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "-1"], "Invalid value for --window: must be an integer >= 0"),  # the option named
        (["--ngram", "1"], "Invalid value for --ngram: must be an integer >= 2"),
        (["--suffix", "-1"], "Invalid value for --suffix: must be an integer >= 0"),
        (["--dtype", "int3"], "must be one of"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--window", "50"], "window x (ngram - 1) must be below 128"),
        (["--temperature", "0.7", "--seed", str(2**64)], "--seed"),
        (["--gguf-file", "nope.gguf"], "Invalid value for --gguf-file: names a file inside --model's folder: give "
                                       "--model too"),
    ],
)
def test_bad_options_exit_with_a_clear_message(args, message):
    result = run_cli("generate", "hello", *args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.slow
def test_generate_sampling_is_reproducible_with_a_seed():
    args = ["generate", "Name three colors.", "--temperature", "0.9", "--top-k", "30", "--top-p", "0.95",
            "--max-new-tokens", "24", "--json"]
    first, again, other = run_cli(*args, "--seed", "4"), run_cli(*args, "--seed", "4"), run_cli(*args, "--seed", "5")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["text"] == json.loads(again.stdout)["text"]
    assert json.loads(first.stdout)["text"] != json.loads(other.stdout)["text"]  # the seed is used
    compared = run_cli(*args, "--seed", "4", "--compare")
    report = json.loads(compared.stdout)
    assert report["identical"] is None and report["baseline_seconds"] > 0  # samples are not compared token-wise


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "must be a number >= 0"),
        (["--top-p", "1.5"], "must be a number in (0, 1]"),
        (["--top-k", "-2"], "must be an integer >= 0"),
        (["--repetition-penalty", "0"], "must be a number > 0"),
    ],
)
def test_bad_sampling_options_exit_with_a_clear_message(args, message):
    result = run_cli("generate", "hello", *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_the_version_is_the_installed_distributions():
    import tomllib
    from pathlib import Path

    import lookahead

    result = run_cli("--version")
    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert result.returncode == 0 and result.stdout.strip() == f"lookahead {declared}"
    assert lookahead.__version__ == declared


def test_the_package_imports_from_a_source_tree_with_no_distribution_installed(monkeypatch):
    """scripts/gpu_check.sh runs the sources from src/ on a machine where nothing of ours is installed: the
    version lookup had raised PackageNotFoundError there, failing every part of the check."""
    import importlib
    from importlib import metadata

    import lookahead

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    try:
        assert importlib.reload(lookahead).__version__ == "0+unknown"
    finally:
        monkeypatch.undo()
        importlib.reload(lookahead)


def test_help_and_refusals_answer_without_importing_torch():
    """`lookahead --help`, `--version` and a refused option took 5 s, importing torch and transformers first;
    importing the package or its CLI now leaves them for the commands that run."""
    probe = ("import sys, typer.testing, lookahead, lookahead.cli as cli\n"
             "for args in (['--help'], ['generate', '--help'], ['bench', 'corpus', '--help'], ['--version'],"
             " ['generate', 'hi', '--top-p', '2']):\n"
             "    typer.testing.CliRunner().invoke(cli.app, args)\n"
             "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))\n"
             "from lookahead import generate, Corpus\n"
             "print('torch' in sys.modules, callable(generate))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True True"]
    # Imported first in a fresh process: models -> quant -> kernels -> models was a cycle that
    # `from lookahead import load_model` met once nothing else was imported before it.
    for first in ("from lookahead import load_model", "import lookahead.kernels"):
        result = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (first, result.stderr)


def test_a_prompt_of_dash_is_read_from_standard_input_and_a_blank_one_refused(tiny_dir):
    import typer.testing

    from lookahead import cli

    def generate(prompt: str, stdin: str | None = None):
        return typer.testing.CliRunner().invoke(cli.app, ["generate", prompt, "--model", tiny_dir, "--json",
                                                          "--max-new-tokens", "4", "--raw"], input=stdin)

    given, piped = generate("Once upon a time"), generate("-", "Once upon a time")
    assert given.exit_code == piped.exit_code == 0
    assert json.loads(piped.stdout)["text"] == json.loads(given.stdout)["text"]
    for blank in ("  \n", "-"):
        refused = generate(blank, "\n\n")
        assert refused.exit_code == 2 and "the prompt is empty (or blank)" in refused.stderr


@pytest.mark.parametrize("raw", [False, True])
def test_a_piped_chat_prompt_loses_the_line_end_that_echo_adds_and_a_raw_one_keeps_it(tiny_dir, monkeypatch, raw):
    import typer.testing

    from lookahead import cli, prompts

    encoded = []
    encode = prompts.encode_prompt
    monkeypatch.setattr(prompts, "encode_prompt", lambda tokenizer, text, raw: encoded.append(text) or encode(
        tokenizer, text, raw=raw))
    result = typer.testing.CliRunner().invoke(cli.app, ["generate", "-", "--model", tiny_dir, "--max-new-tokens", "2"]
                                              + ["--raw"] * raw, input="Name three rivers.\n")
    assert result.exit_code == 0 and encoded == ["Name three rivers." + "\n" * raw]


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading_the_model(monkeypatch):
    import socket

    from lookahead import cli

    monkeypatch.setattr(cli, "_load_model", lambda *_: pytest.fail("the model loaded before the address was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_cli("serve", "--port", str(taken.getsockname()[1]))
    assert result.returncode == 2 and "cannot listen on 127.0.0.1:" in result.stderr
    assert "Address already in use" in result.stderr
    result = run_cli("serve", "--host", "no-such-host.invalid")
    assert result.returncode == 2 and "cannot listen on no-such-host.invalid:8000" in result.stderr


@pytest.mark.parametrize("value, words", [("inf", "in (0, 2**40]"), ("1e13", "in (0, 2**40]"),
                                          ("1e-9", "must hold at least one token")])  # (nan: typer's min=0 refuses it)
def test_serve_refuses_a_corpus_cap_no_corpus_takes_by_the_option_before_loading_the_model(monkeypatch, value, words):
    """The refusal had come once the model had loaded, naming max_megabytes and a range without 0, which --corpus-mb
    takes (no corpus)."""
    from lookahead import cli

    monkeypatch.setattr(cli, "_load_model", lambda *_: pytest.fail("the model loaded before --corpus-mb was checked"))
    result = run_cli("serve", "--corpus-mb", value, "--port", "0")
    message = " ".join(result.stderr.replace("│", " ").split())
    assert result.returncode == 2 and "--corpus-mb" in message and "must be 0 (no corpus) or a corpus's cap" in message
    assert words in message


def test_bench_refuses_an_out_folder_it_cannot_write_into_before_any_work(tmp_path, monkeypatch):
    from lookahead import cli

    def refused(**_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli.tempfile, "TemporaryFile", refused)
    result = run_cli("bench", "--out", str(tmp_path), "--max-new-tokens", "2")
    assert result.returncode == 2 and "cannot write into the folder" in result.stderr
    assert "Permission denied" in result.stderr
