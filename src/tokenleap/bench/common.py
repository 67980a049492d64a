"""What every part of the bench shares: the error type, one generation's result, the method protocol."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenleap.config import SamplingParams
from tokenleap.errors import TokenleapError

TOKENLEAP, PEER = "tokenleap", "peer"  # method kinds
# family -> allowed options; "k" accepts "auto" for tokenleap's adaptive draft length
FAMILIES: dict[str, tuple[str, ...]] = {
    "plain": (),
    # tree=auto|on|off (default off: chains), nodes: its budget; model=NAME: this method's draft instead of --draft;
    # stop=on|off: a chain cut short where the draft is unsure (default on, with an adaptive k)
    "draft": ("k", "kmax", "vocab", "tree", "nodes", "model", "stop"),
    # pool=N: n-gram lookup also in the last N tokens of the earlier prompts' outputs (--ngram-pool)
    "ngram": ("k", "kmax", "max", "min", "tree", "nodes", "pool"),
    "draft-tree": ("k", "kmax", "vocab", "nodes"),  # token trees of at most `nodes` drafted nodes, k deep
    "ngram-tree": ("k", "kmax", "max", "min", "nodes"),
    "cascade": ("k", "kmax", "vocab", "model", "stop", "pool"),  # draft, its own steps speculated by n-gram lookup (--draft-spec ngram)
    "lookahead": ("k", "kmax", "window", "ngram", "guesses", "max"),  # max: the text lookup's longest match
    "auto": ("k", "kmax", "max", "min", "vocab", "stop", "pool"),  # per request and step: n-gram, the --draft model, ... or plain
    # skip=auto (calibrated, stored per model) or a list like 4-6+10-14; lookup=on|off: copied text by prompt lookup
    "layerskip": ("k", "kmax", "skip", "lookup"),
    # a trained draft head on the target's features (--spec eagle); head=auto (stored for the target) or a file
    "eagle": ("k", "kmax", "head", "stop"),
    "hf-plain": (),
    "hf-assisted": ("k",),
    "hf-prompt-lookup": ("k", "max"),
    "llamacpp-plain": (),
    "llamacpp-prompt-lookup": ("k", "max"),
}
AUTO_K_FAMILIES = {"draft", "ngram", "draft-tree", "ngram-tree", "cascade", "lookahead", "auto", "layerskip", "eagle"}
TREE_NODES = 15  # a tree method's default node budget (with the root: 16 rows, one AMX tile of rows)
TREE_MODES = ("auto", "on", "off")  # draft:tree=auto -- the controller chooses plain / chain / tree per step


class BenchError(TokenleapError):
    """Bad bench input (dataset, method list, output directory); the message says what to do."""


@dataclass
class Generation:
    """One request's outcome. ``seconds`` is wall time around the whole request, prefill included."""

    token_ids: list[int]
    text: str
    seconds: float
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # SpecStats.to_dict() + raw per-position counts (tokenleap only)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class MethodInfo:
    """How a method was built, for results.json (``status``: ok | skipped | failed)."""

    name: str
    family: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    reason: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # dtype, quant, load seconds, RSS after load

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "kind": self.kind, "options": self.options,
                "status": self.status, "reason": self.reason, **self.detail}


class BenchMethod(Protocol):
    """A decoding method under test. ``generate`` runs one request on already-encoded prompt ids."""

    name: str  # e.g. "draft:k=4"
    kind: str  # TOKENLEAP or PEER

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...
