"""One request's decoding state: tokens, text, stop rules, generator, statistics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.logprobs import TokenLogprob
from tokenleap.spec.stats import SpecStats
from tokenleap.spec.stop_strings import OpenStops


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    detokenizer: object  # detokenizer.IncrementalDetokenizer: .add(ids) -> str, .flush() -> str
    generator: torch.Generator | SeededNoise | None = None
    slot: int = -1
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    text: str = ""  # generated text (stop string removed once matched)
    streamed: int = 0  # characters of ``text`` already handed out
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # what ended a "stop": the stop token id or the stop string matched (None: an EOS token), as vLLM's
    stop_reason: int | str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, if params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # per prompt token
    # prompt tokens the prefix cache held from earlier requests at the first attach (not computed), as
    # vLLM reports them: a preempted sequence resuming from its own blocks does not count them again
    cached_tokens: int = 0
    attached_before: bool = False  # attached once already (a later attach resumes after a preemption)
    constraint: Any = None  # structured.Constraint: the grammar state of a structured-output request
    first_token_time: float | None = None  # (perf_counter) for t_max_predict_ms
    saw_new_line: bool = False  # t_max_predict_ms: the reply has had a new line
    indent_checked: int = 0  # n_indent: text before this has had its lines' indentation checked
    # unseeded verification's trials (acceptance.Trial), kept only where a list is set: tokenleap verify's count
    trials: list | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)
        self.stop_ids = frozenset(self.params.stop_token_ids)  # (a list of a million ids: a lookup, not a scan)
        self.open_stops = OpenStops(self.params.stop)  # how much of the text's end could still begin a stop string

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, new_tokens: list[int]) -> int:
        """Add verified tokens one by one until a stop rule fires; returns how many were kept."""
        kept = 0
        for tok in new_tokens:
            if self.finished:
                break
            self.tokens.append(tok)
            kept += 1
            eos = tok in self.eos_ids and not self.params.ignore_eos
            if eos or tok in self.stop_ids:
                self.finish_reason = "stop"
                self.stop_reason = None if eos else tok
                self.text += self.detokenizer.flush()
                break
            piece = self.detokenizer.add([tok])
            self.text += piece
            if self._match_stop(len(piece)) or self._code_stop("\n" in piece):
                break
            if self.num_generated >= self.params.max_tokens:
                self.finish_reason = "length"
                self.text += self.detokenizer.flush()
        return kept

    def _match_stop(self, new_chars: int) -> bool:
        """A stop string ending in the last ``new_chars`` characters of ``text`` ends the reply there.
        Only those endings are looked at (as vLLM does): earlier ones were looked at when their token
        came, or fell inside ``min_tokens`` -- so where a match is found never depends on how many
        tokens a step added, and it never starts in text already handed out (``take_text``)."""
        if not self.params.stop or self.num_generated < self.params.min_tokens or not new_chars:
            return False
        end = len(self.text) - new_chars + 1  # (each stop string's window: its endings in the new text)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, max(0, end - len(s)))) >= 0]
        if not hits:
            return False
        i, self.stop_reason = min(hits, key=lambda hit: hit[0])
        self.text = self.text[:i + (len(self.stop_reason) if self.params.include_stop_str_in_output else 0)]
        self.finish_reason = "stop"
        return True

    def _code_stop(self, new_line: bool) -> bool:
        """llama.cpp's ``n_indent`` and ``t_max_predict_ms`` (code completion): a line that starts less
        indented than ``n_indent`` ends the reply after its indentation; past the time limit, a reply
        holding a new line ends. Either is a "length" finish (llama.cpp's "limit")."""
        p = self.params
        if not (p.n_indent or p.t_max_predict_ms):
            return False
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.saw_new_line = self.saw_new_line or new_line
        cut = None
        if p.n_indent:
            start = self.text.find("\n", self.indent_checked)
            while start >= 0:
                line = self.text[start + 1:]
                body = line.lstrip(" \t")
                if not body:
                    break  # the line's indentation is not known yet
                self.indent_checked = start + 1
                if len(line) - len(body) < p.n_indent:
                    cut = start + 1 + len(line) - len(body)
                    break
                start = self.text.find("\n", start + 1)
        late = p.t_max_predict_ms and self.saw_new_line and now - self.first_token_time > p.t_max_predict_ms / 1000
        if cut is None and not late:
            return False
        if cut is not None:
            self.text = self.text[:cut]
        self.finish_reason = "length"
        return True

    def take_text(self) -> str:
        """New text safe to show: held back while it could still be the start of a stop string, or
        (``n_indent``) from a new line on until its indentation is known."""
        end = len(self.text)
        if not self.finished and self.params.n_indent:
            nl = self.text.rfind("\n")
            if nl >= 0 and not self.text[nl + 1:].strip(" \t"):
                end = nl
        if not self.finished and self.params.stop:  # the text's end that a stop string could still start with
            end = max(self.streamed, min(end, len(self.text) - self.open_stops.open_length(self.text)))
        piece = self.text[self.streamed:end]
        self.streamed = end
        return piece

