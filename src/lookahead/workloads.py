"""Prompt sets for tests and benchmarks: the vendored MT-bench, HumanEval, GSM8K, Spec-Bench, code edits
built from HumanEval's solutions, or a user's JSONL file."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN = ("mt_bench", "humaneval", "gsm8k", "spec_bench", "code_edit")
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
# `lookahead bench corpus`'s two requests over each document: differently worded (the replies share little text
# beyond the document's own), or the same request again (a client's retry, another user asking the same: with greedy
# decoding the second reply is the first one, all of it in the corpus).
CORPUS_PAIRS = {
    "summaries": ("Summarize this article in two sentences.", "Give a short summary of the article."),
    "retry": ("Summarize this article in two sentences.",) * 2,
}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]  # user turns; with a chat template each is a user message, else the text itself
    raw: bool = False  # True: feed the text as is, without the chat template


def _lines(name: str) -> list[dict]:
    files = resources.files("lookahead") / "data"
    if name == "humaneval":
        with gzip.open(files.joinpath("humaneval/HumanEval.jsonl.gz").open("rb"), "rt") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    path = {"mt_bench": "mt_bench/question.jsonl", "gsm8k": "gsm8k/test.jsonl", "spec_bench": "spec_bench/question.jsonl"}[name]
    return [json.loads(line) for line in files.joinpath(path).read_text().splitlines() if line.strip()]


def humaneval_chat_turn(code: str) -> str:
    return f"Complete the following Python function.\n\n```python\n{code}```"


# Edits whose answer restates most of the code in the prompt, where drafting by copying from the prompt
# pays most (transformers' prompt lookup, our suffix source).
CODE_EDITS = {  # category -> what is asked
    "comments": "Add a comment above each line of the function body explaining what it does.",
    "type_checks": "Add type checks at the start of the function that raise TypeError for arguments of the wrong type.",
    "renames": "Rename the function's local variables to more descriptive names.",
}


def code_edit_turn(code: str, edit: str) -> str:
    return f"{CODE_EDITS[edit]} Reply with the whole function in one code block.\n\n```python\n{code}```"


def load_workload(name: str, turns: int = 1, raw: bool = False) -> list[Prompt]:
    """Prompts of a built-in workload (see BUILTIN) or of a JSONL file with a `prompt` or `turns` field.

    turns: how many user turns of multi-turn data to keep (1 or 2). raw: the text as it is, without the chat
    template (HumanEval: its prompt as a raw completion, not the chat request around it). Raises ValueError,
    naming the file and line, for a JSONL file that is not a list of such objects or holds no prompt.
    """
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns!r}")
    if name == "humaneval":
        return [
            Prompt(row["task_id"], "humaneval", (row["prompt"] if raw else humaneval_chat_turn(row["prompt"]),), raw)
            for row in _lines(name)
        ]
    if name == "code_edit":  # HumanEval's functions with their solutions, each asked one of the edits in turn
        edits = list(CODE_EDITS)
        return [Prompt(row["task_id"].replace("HumanEval", "code_edit"), edits[index % len(edits)],
                       (code_edit_turn(row["prompt"] + row["canonical_solution"], edits[index % len(edits)]),), raw)
                for index, row in enumerate(_lines("humaneval"))]
    if name == "gsm8k":
        return [Prompt(f"gsm8k/{index}", "gsm8k", (row["question"],), raw) for index, row in enumerate(_lines(name))]
    if name in ("mt_bench", "spec_bench"):
        prompts = []
        for row in _lines(name):
            category = row["category"]
            if name == "spec_bench" and category in MT_BENCH_CATEGORIES:
                category = "multi_turn_chat"
            prompts.append(Prompt(str(row["question_id"]), category, tuple(row["turns"][:turns]), raw))
        return prompts
    path = Path(name)
    if not path.is_file():
        looks_like_a_file = path.suffix or path.parent != Path(".")
        raise ValueError(f"dataset must be one of {BUILTIN} or a JSONL file, got {name!r}"
                         + (": no such file" if looks_like_a_file else ""))
    prompts = []
    lines_of: dict[str, int] = {}  # id -> its line
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot be read as UTF-8 text ({error})") from error
    for index, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{index + 1}"
        try:
            row = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{where}: not JSON ({error})") from error
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be an object with a 'prompt' or 'turns' field, got "
                             f"{type(row).__name__}")
        if "turns" in row:
            given = row["turns"]
            if not (isinstance(given, list) and given and all(isinstance(t, str) and t for t in given)):
                raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
            texts = tuple(given[:turns])
        elif "prompt" in row:
            if not (isinstance(row["prompt"], str) and row["prompt"]):
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            texts = (row["prompt"],)
        else:
            raise ValueError(f"{where}: each line needs a 'prompt' or 'turns' field")
        prompt = Prompt(str(row.get("id", index)), str(row.get("category", path.stem)), texts, raw)
        # Reports pair each method's run with the baseline's by id, and sum every prompt in the category "all".
        if prompt.id in lines_of:
            raise ValueError(f"{where}: id {prompt.id!r} is line {lines_of[prompt.id]}'s too: each prompt needs "
                             "an id of its own (a line without one takes its index from 0)")
        if prompt.category == "all":
            raise ValueError(f"{where}: the category 'all' names the row of every prompt in reports: name it otherwise")
        lines_of[prompt.id] = index + 1
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompt: one JSON object a line, with a 'prompt' or 'turns' field")
    return prompts
