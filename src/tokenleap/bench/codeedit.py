"""The ``codeedit`` dataset: rewrite tasks on real functions from the Python standard library.

Built deterministically: the source of a fixed list of pure-Python stdlib modules is parsed with
``ast`` (the files are read, not imported); a function qualifies when it is top-level or a method (not nested), has no decorators,
spans 8..30 lines and at most 1,600 characters. Each task kind has its own eligibility rule and
takes qualifying functions round-robin over the module list (in source order within a module),
never reusing a function. The set therefore changes only with the Python version, which
results.json records.
"""
from __future__ import annotations

import ast
import importlib.util
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator

MODULES = ("textwrap", "shlex", "difflib", "heapq", "colorsys", "calendar", "statistics", "urllib.parse",
           "base64", "glob", "gettext", "ipaddress", "string", "email.utils", "configparser", "argparse",
           "pprint", "locale", "mimetypes", "zipfile")
PER_KIND = 10
MIN_LINES, MAX_LINES, MAX_CHARS = 8, 30, 1600

_FENCE = "```"


def _no_annotations(fn: ast.FunctionDef) -> bool:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    named = [a for a in args if a.arg not in ("self", "cls")]
    return bool(named) and fn.returns is None and all(a.annotation is None for a in args)


def _is_old_format(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
    return False


def _uses_old_format(fn: ast.FunctionDef) -> bool:
    return any(_is_old_format(n) for n in ast.walk(fn))


def _no_docstring(fn: ast.FunctionDef) -> bool:
    return ast.get_docstring(fn) is None


def main_local(fn: ast.FunctionDef) -> str | None:
    """The assigned local name used most often (first assigned wins ties), if used >= 3 times."""
    stored = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    if not stored:
        return None
    uses = Counter(n.id for n in ast.walk(fn) if isinstance(n, ast.Name))
    best = max(dict.fromkeys(stored), key=lambda name: uses[name])  # max keeps the first of equals
    return best if uses[best] >= 3 else None


def _type_hints(fn: ast.FunctionDef) -> str:
    return ("Add type hints to every parameter and to the return value of this Python function. "
            "Reply with the complete rewritten function only.")


def _f_strings(fn: ast.FunctionDef) -> str:
    return ("Convert every %-formatting and str.format() call in this Python function to f-strings, "
            "keeping the behaviour identical. Reply with the complete rewritten function only.")


def _docstring(fn: ast.FunctionDef) -> str:
    return ("Add a docstring to this Python function that explains what it does, its parameters and "
            "its return value. Reply with the complete function only.")


def _rename(fn: ast.FunctionDef) -> str:
    return (f"Rename the local variable `{main_local(fn)}` in this Python function to a more descriptive "
            "name, everywhere it is used. Reply with the complete rewritten function only.")


# kind -> (eligibility rule, instruction)
TASKS: dict[str, tuple[Callable[[ast.FunctionDef], bool], Callable[[ast.FunctionDef], str]]] = {
    "type-hints": (_no_annotations, _type_hints),
    "f-strings": (_uses_old_format, _f_strings),
    "docstring": (_no_docstring, _docstring),
    "rename": (lambda fn: main_local(fn) is not None, _rename),
}


def _functions(tree: ast.Module, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef]]:
    """Top-level functions and methods of top-level classes, in source order."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef) and not prefix:
            yield from _functions(ast.Module(body=node.body, type_ignores=[]), f"{node.name}.")


def candidates(module_name: str) -> list[tuple[str, str, ast.FunctionDef]]:
    """(qualified name, dedented source, node) of a module's functions of moderate size."""
    spec = importlib.util.find_spec(module_name)  # read the file; no import needed
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines(keepends=True)
    out = []
    for qualname, fn in _functions(ast.parse(source)):
        n = fn.end_lineno - fn.lineno + 1
        text = textwrap.dedent("".join(lines[fn.lineno - 1:fn.end_lineno]))
        if fn.decorator_list or not MIN_LINES <= n <= MAX_LINES or len(text) > MAX_CHARS:
            continue
        out.append((f"{module_name}.{qualname}", text, fn))
    return out


def _pick(kind: str, pools: list[list[tuple[str, str, ast.FunctionDef]]], used: set[str]) -> list[dict]:
    rule, instruction = TASKS[kind]
    picked: list[dict] = []
    iters = [iter([c for c in pool if rule(c[2])]) for pool in pools]
    while len(picked) < PER_KIND and iters:
        for it in list(iters):
            item = next((c for c in it if c[0] not in used), None)
            if item is None:
                iters.remove(it)
                continue
            used.add(item[0])
            message = f"{instruction(item[2])}\n\n{_FENCE}python\n{item[1].rstrip()}\n{_FENCE}\n"
            picked.append({"id": f"codeedit/{kind}/{item[0]}", "category": kind, "prompt": message})
            if len(picked) == PER_KIND:
                break
    return picked


def build_codeedit() -> list[dict]:
    """All tasks, kinds interleaved (so ``--limit`` keeps a mix): dicts with id, category, prompt."""
    pools = [candidates(m) for m in MODULES]
    used: set[str] = set()
    per_kind = [_pick(kind, pools, used) for kind in TASKS]
    mixed = []
    for i in range(max(len(p) for p in per_kind)):
        mixed += [p[i] for p in per_kind if i < len(p)]
    return mixed
