"""Layer-skip self-speculation (Draft & Verify, SWIFT): the draft is the target model itself with
a subset of its decoder layers skipped -- no second model, no extra weights.

A drafted row runs only the kept layers (a skipped layer passes the hidden state through), then
the target's own final norm and LM head. It reads the target's KV cache for the layers it runs:
the committed entries there are the target's own values. Its own rows' keys and values go into
the target's cache at the drafted positions (kept layers only), which cannot corrupt the target:

* the step's verification forward writes every layer at every drafted position (the sequence's
  last token and the drafts) before any row reads it, so no draft entry survives into a
  verified row; a rejected tail is then truncated as always;
* after drafting the slot's length is set back to the committed length with ``commit`` (not
  ``truncate``), so a paged cache keeps the blocks the scheduler reserved for this step (the
  drafts write at most the positions the verification writes: inside that reservation);
* skipped layers are never written nor read by a draft row.

Drafting is batched like a draft model's: draft position j of every sequence in one forward of
one row each, row-exact (the compiled decode path). In sampling mode each drafted token is drawn
from the skipped-layer distribution q, which the verification's rejection sampling uses (seeded
requests: the drafter-invariant choice), so every mode stays exact. Chains only: a request with a
tree budget gets a chain.

With a ``lookup`` (prompt lookup, ``NgramProposer``), a sequence whose text is being copied -- the
latest earlier occurrence of its suffix of at least ``LOOKUP_MIN`` tokens is followed by the k tokens
asked for -- takes that continuation as its draft instead (free, deterministic: q is one-hot), and
only the others run the skipped-layer forwards: code being edited drafts as prompt lookup does, free
text as layer skip does, with still no second model.

``skip="auto"`` picks the skipped set by a short calibration on a request's own tokens
(``layerskip_search.py``) once one has ``CALIBRATION_MIN_TOKENS`` (plain steps before, bar prompt
lookup's drafts), unless one is given up front (cached on disk by ``proposers.factory.build_proposer``).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenleap.cache.contiguous import CacheFullError
from tokenleap.config import ConfigError
from tokenleap.models.transformer import Segment, Transformer
from tokenleap.spec.confidence import Calibration, ConfidenceLog
from tokenleap.spec.proposers.base import Draft, DraftRequest
from tokenleap.spec.proposers.draft_model import DraftingLane
from tokenleap.spec.proposers.ngram import NgramProposer


MAX_LAYERS = 1024  # more layers than any model has: a bound for a skip list before the model is known


def parse_skip_layers(text: str, num_layers: int | None = None) -> frozenset[int] | str:
    """``"auto"`` or a list like ``4,5,6,10-14`` (``+`` also separates, for bench options) -> layer
    indices; ConfigError names the bad part. With ``num_layers`` every index must exist."""
    text = text.strip()
    if text == "auto":
        return "auto"
    out: set[int] = set()
    for part in (p.strip() for p in text.replace("+", ",").split(",")):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ConfigError(f"skip layers: {part!r} is not a layer index or range (use e.g. 4,5,6,10-14 "
                              f"or auto)") from None
        if a < 0 or b < a:
            raise ConfigError(f"skip layers: {part!r} is not a layer index or ascending range")
        if b >= MAX_LAYERS:  # (before the range is built: 0-999999999 is one part)
            raise ConfigError(f"skip layers: {part!r} goes past any model's layers (fewer than {MAX_LAYERS})")
        out.update(range(a, b + 1))
    if num_layers is not None:
        check_skip(frozenset(out), num_layers)
    return frozenset(out)


def check_skip(skip: frozenset[int], num_layers: int) -> None:
    bad = sorted(i for i in skip if not 0 <= i < num_layers)
    if bad:
        shown = bad if len(bad) <= 8 else f"{bad[0]} .. {bad[-1]} ({len(bad)} of them)"
        raise ConfigError(f"skip layers {shown} do not exist: the model has layers 0-{num_layers - 1}")
    if len(skip) >= num_layers:
        raise ConfigError(f"skip layers: skipping all {num_layers} layers leaves no draft; keep at least one")


def format_skip(skip: frozenset[int]) -> str:
    """Layer indices as ranges: {4, 5, 6, 10} -> "4-6,10" (parse_skip_layers reads it back)."""
    parts, run = [], []
    for i in sorted(skip):
        if run and i != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts) or "none"


@dataclass(eq=False)
class _Lane(DraftingLane):
    """One sequence's drafting within ``propose_many``."""

    index: int  # position in the request list
    req: DraftRequest
    committed: int  # the slot's cache length before drafting (len(tokens) - 1)
    pos: int  # cache position of the next row to feed
    pending: int  # the token to feed next
    drafted: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # each [1, vocab]
    pushed: int = 0  # drafted tokens the request's grammar followed (undone after drafting)
    confidences: list[float] = field(default_factory=list)
    calibration: Calibration | None = None


LOOKUP_MIN = 2  # a lookup continuation stands in for the skipped-layer draft only after a match this long
CALIBRATION_MIN_TOKENS = 32  # skip=auto calibrates once a request has this many tokens (plain steps before)
HEAD_TOKENS = 32768  # the drafts' head scores the first this-many ids and the special tokens (layerskip_head.py)

# calibrate(model, tokens) -> the skipped set for this model, chosen on one request's tokens
Calibrate = Callable[[Transformer, list[int]], frozenset[int]]


class LayerSkipProposer:
    name = "layerskip"
    # a chain honours DraftRequest.stop_below when asked, but the engine does not ask: on the int4
    # 1.5B the cut measured 0.96x the uncut chain on HumanEval (BENCHMARKS.md, "A draft model's chain
    # cut short where the draft is unsure")
    stops_on_confidence = False

    def __init__(self, model: Transformer, skip: frozenset[int] | None, calibrate: Calibrate | None = None,
                 head=None, lookup: NgramProposer | None = None, predicted_speedup: float | None = None) -> None:
        """``skip``: the layers drafted rows skip; None: chosen by ``calibrate`` once a request is long enough.
        ``head``: the drafts' LM head (``layerskip_head.prefix_head``: views of the target's); None: the target's.
        ``lookup``: prompt lookup, whose continuation replaces the draft of a sequence copying its text.
        ``predicted_speedup``: the stored calibration's prediction for drafting by these layers alone,
        measured on this machine (None: no stored calibration when built -- a skipped set given, or
        one chosen later)."""
        if skip is None and calibrate is None:
            raise ConfigError("layer skip needs a skipped set or a calibration to choose one")
        if skip is not None:
            check_skip(frozenset(skip), model.config.num_hidden_layers)
        self.model = model
        self.head = head
        self.confidence = ConfidenceLog()  # where a chain asked to stop on confidence learns how far to trust it
        self.skip = frozenset(skip) if skip is not None else None
        self._calibrate = calibrate
        self.lookup = lookup
        self.predicted_speedup = predicted_speedup
        self.cache = None  # the target's cache, from the engine (bind_cache)

    def bind_cache(self, cache) -> None:
        """The engine hands over its cache: drafts read the committed entries and write their rows there."""
        self.cache = cache

    @property
    def parts(self) -> list:
        return [self.lookup] if self.lookup is not None else []

    # -- lifecycle: the target's cache holds everything the draft needs --------------------------
    def begin(self, seq_id: int, prompt: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.begin(seq_id, prompt)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        pass

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        return 0

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        # (the engine truncated or compacted the target's cache: nothing of the draft's is left)
        self.confidence.verified(seq_id, num_accepted)

    def end(self, seq_id: int) -> None:
        self.confidence.end(seq_id)
        if self.lookup is not None:
            self.lookup.end(seq_id)

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, seq_id: int, tokens: list[int], k: int, params, generator) -> Draft | None:
        raise ConfigError("the layer-skip proposer drafts in the target's cache: call propose_many with the "
                          "sequence's slot (DraftRequest.slot), as the engine does")

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        if self.cache is None:
            raise ConfigError("the layer-skip proposer is not bound to an engine's cache (Engine does this)")
        out: list[Draft | None] = [None] * len(requests)
        catch_up = 0.0
        longest = max((r.tokens for r in requests), key=len, default=()) if self.skip is None else ()
        if len(longest) >= CALIBRATION_MIN_TOKENS:
            # skip=auto: calibrate once, on a request's own tokens (the longest; a shorter text than this
            # scores too few positions to choose by, and its choice is stored for the model)
            t0 = time.perf_counter()
            self.skip = frozenset(self._calibrate(self.model, list(longest)))
            catch_up = time.perf_counter() - t0  # one-off set-up work, not the draft's cost per token
        lanes = []
        for i, r in enumerate(requests):
            committed = len(r.tokens) - 1
            if (r.k <= 0 or r.slot < 0 or len(r.tokens) + r.k > self.cache.max_len
                    or self.cache.lengths[r.slot] != committed):
                continue
            if (copied := self._copied(r)) is not None:
                out[i] = copied
                continue
            if self.skip is None:  # not calibrated yet: prompt lookup's drafts only
                continue
            lanes.append(_Lane(i, r, committed, committed, r.tokens[-1], calibration=self.confidence.calibration))
        active = lanes
        while active := [l for l in active if l.wants_more()]:
            if not self._draft_position(active):  # a paged cache out of blocks: no draft for these
                for l in active:
                    l.drafted, l.probs = [], []
                active = []
        for l in lanes:
            self.cache.commit(l.req.slot, l.committed)  # drafts' entries lie past it (blocks kept)
            l.rollback()
            self.confidence.drafted(l.req.seq_id, l.confidences if l.drafted else [])
            if l.drafted:
                out[l.index] = Draft(tokens=l.drafted, probs=l.q(), cut=l.cut)
        if catch_up:
            first = next((i for i, d in enumerate(out) if d is not None), None)
            d = out[first] if first is not None else Draft(tokens=[], probs=None)
            out[first or 0] = Draft(tokens=d.tokens, probs=d.probs, catch_up_seconds=catch_up)
        return out

    def _copied(self, r: DraftRequest) -> Draft | None:
        """The lookup's continuation when it gives all k tokens (its matches are ``LOOKUP_MIN`` long or more)."""
        if self.lookup is None:
            return None
        found = self.lookup.propose(r.seq_id, r.tokens, r.k, r.params, r.generator)
        return found if found is not None and len(found.tokens) >= r.k else None

    def _draft_position(self, lanes: list[_Lane]) -> bool:
        """Feed every lane's pending token through the kept layers in one forward and draft each
        lane's next token (the row's logits: [lanes, vocab])."""
        segments = [Segment(l.req.slot, l.pos, 1, row_start=j) for j, l in enumerate(lanes)]
        tokens = torch.tensor([l.pending for l in lanes])
        try:
            logits = self.model(tokens, segments, self.cache, row_exact=True, skip=self.skip, head=self.head).logits
        except CacheFullError:
            return False
        for j, l in enumerate(lanes):
            l.pos += 1
            l.pending = l.take(logits[j : j + 1], l.pos)
        return True


_ANNOUNCED: set = set()  # calibration files whose use was said on stderr


def _stderr(line: str) -> None:
    print(f"[tokenleap] {line}", file=sys.stderr)


def layerskip_proposer(target, skip_layers: str, cache_dir=None, log=None, lookup: int = 0) -> LayerSkipProposer:
    """The proposer for a loaded target (``models.pretrained.LoadedModel``): ``skip_layers`` a list,
    or ``"auto"``: the calibration stored for this model, dtype and quantization under the cache
    dir, else one made on a request's tokens once one has ``CALIBRATION_MIN_TOKENS`` and stored for next time.
    ``log(str)``: one line when a calibration is read or made (default: stderr). ``lookup`` > 0:
    copied text drafts by prompt lookup on suffixes of up to that many tokens (``LOOKUP_MIN`` at least)."""
    from tokenleap.models.checkpoint import model_key
    from tokenleap.spec.proposers import layerskip_search as ls

    from tokenleap.spec.proposers.layerskip_head import prefix_head

    model, layers = target.model, target.model.config.num_hidden_layers
    specials = set(target.tokenizer.eos_token_ids or ()) | set(model.config.eos_token_ids)
    backend = getattr(target.tokenizer, "backend", None)
    if backend is not None:
        specials |= set(backend.get_added_tokens_decoder().keys())
    head = prefix_head(model, HEAD_TOKENS, specials)
    skip = parse_skip_layers(skip_layers, layers)
    finder = NgramProposer(max(lookup, LOOKUP_MIN), LOOKUP_MIN) if lookup else None
    if skip != "auto":
        return LayerSkipProposer(model, skip, head=head, lookup=finder)
    say = log or _stderr
    path = ls.store_path(cache_dir, model_key(target.source, target.gguf_path, target.dtype, target.quant))
    cal = ls.load_calibration(path, layers)
    if cal is not None:
        if log is not None or path not in _ANNOUNCED:  # on stderr once a process: an LLM builds a proposer
            _ANNOUNCED.add(path)                        # for each engine
            say(f"layer skip: skipping layers {format_skip(cal.skip_set)} of {layers} (calibrated, {path}; "
                f"{_predicted(cal.predicted_speedup)})")
        return LayerSkipProposer(model, cal.skip_set, head=head, lookup=finder, predicted_speedup=cal.predicted_speedup)

    def calibrate(m: Transformer, tokens: list[int]) -> frozenset[int]:
        cal = ls.search(m, [tokens], head=head)
        try:
            ls.save_calibration(path, cal)
        except OSError as e:
            say(f"layer skip: could not store the calibration at {path}: {e.strerror}")
        say(f"layer skip: calibrated in {cal.search_seconds:.1f}s on this request: skipping layers "
            f"{format_skip(cal.skip_set)} of {layers} (agreement {cal.agreement:.2f}, "
            f"{_predicted(cal.predicted_speedup)}); stored at {path}")
        return cal.skip_set

    return LayerSkipProposer(model, None, calibrate, head=head, lookup=finder)


def _predicted(speedup: float) -> str:
    """The calibration's predicted speed, and what a figure below plain decoding's means for the run."""
    return f"predicted {speedup:.2f}x" + (": below plain decoding, so steps draft only where the measured costs "
                                          "say it pays" if speedup < 1 else "")
