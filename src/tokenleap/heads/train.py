"""Training a feature-level draft head (``heads/eagle.py``) on a target's own hidden states.

For each training text the target's features f_0 .. f_{n-1} are computed once (a prefill pass,
``collect_features``). The head reads (f_t, emb(x_{t+1})) and is trained to predict f_{t+1}: a
smooth-L1 loss on the feature plus a cross-entropy between the target's next-token distribution
head(f_{t+1}) and the head's head(f^_{t+1}), over the vocabulary subset the head drafts from (the
LM head is the target's, frozen). Noise on the input features (EAGLE's) makes the head tolerate
its own, imperfect features when it drafts several tokens ahead.

The texts are best the target's own replies to prompts like its users' (``tokenleap train-head``
generates them): the head learns what this target writes, not what a corpus says.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenleap.heads.eagle import EagleConfig, EagleHead
from tokenleap.heads.features import Example
from tokenleap.models.pretrained import cpu_has_native_bf16
from tokenleap.spec.proposers.draft_head import float_rows


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    window: int = 1024  # longest run of positions one step trains on
    accumulate: int = 4  # windows a step
    feature_noise: float = 0.05  # input features get noise of this share of their RMS
    ce_weight: float = 1.0  # the distribution term's weight beside the feature term
    valid_share: float = 0.1  # texts held out to report the head's agreement with the target
    # also train the second draft token, made from the head's own prediction (EAGLE-3's training-time
    # test); twice the work a step, and on 58,000 tokens it lowered both positions' acceptance (BENCHMARKS)
    second_step: bool = False
    # the forward and the loss in bfloat16 (autocast; the weights and the optimizer stay float32):
    # twice as fast where the CPU has native bf16 products, much slower where it has not.
    # None: on exactly there (``cpu_has_native_bf16``)
    bf16: bool | None = None
    seed: int = 0


def subset_ids(cfg: EagleConfig, special_ids: Iterable[int]) -> torch.Tensor:
    """The token ids the head drafts among (the prompt's own are added when drafting)."""
    ids = set(range(cfg.subset)) | {i for i in special_ids if 0 <= i < cfg.vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def _windows(examples: list[Example], window: int) -> list[tuple[Example, int, int]]:
    """(example, start, end) runs of at most ``window`` + 1 positions covering every example."""
    runs = []
    for ex in examples:
        n = ex.tokens.shape[0]
        for start in range(0, n - 1, window):
            runs.append((ex, start, min(n, start + window + 1)))
    return runs


def _run(head: EagleHead, model, ex: Example, start: int, end: int, noise: float, gen: torch.Generator | None,
         second: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Predicted and true features [end - start - 1, H] for positions start + 1 .. end - 1, and with
    ``second`` the predictions one token further made from the first ones [end - start - 2, H]."""
    feats = ex.feats[start:end].float()  # [m, H]
    inputs = feats[:-1]
    if noise:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        inputs = inputs + noise * rms * torch.randn(inputs.shape, generator=gen)
    with torch.no_grad():
        embeds = model.embed(ex.tokens[start + 1:end]).float()  # [m - 1, H]
    pred, again = head.two_steps(inputs, embeds, torch.arange(start, end - 1), second)
    return pred, feats[1:], again


def _loss(pred: torch.Tensor, true: torch.Tensor, rows: torch.Tensor,
          ce_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, how many rows' argmax over the subset agrees with the target's)."""
    reg = F.smooth_l1_loss(pred, true)
    logits = pred @ rows.T  # [m, S]
    with torch.no_grad():
        target_logits = true @ rows.T
        p = target_logits.softmax(-1)
    ce = -(p * logits.log_softmax(-1)).sum(-1).mean()
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).sum()
    return reg + ce_weight * ce, agree


def held_out_split(examples: list[Example], share: float, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(held out, the rest): ``share`` of the examples, drawn at random (none from fewer than 10)."""
    examples = list(examples)
    random.Random(seed).shuffle(examples)
    n_valid = int(len(examples) * share) if len(examples) >= 10 else 0
    return examples[:n_valid], examples[n_valid:]


def train_head(model, examples: list[Example], cfg: EagleConfig, special_ids: Iterable[int] = (),
               train: TrainConfig = TrainConfig(), log: Callable[[str], None] = lambda _: None,
               head: EagleHead | None = None, valid: list[Example] | None = None) -> tuple[EagleHead, dict]:
    """A head trained on ``examples``; returns it and a report (losses, held-out agreement: the share
    of positions where the head's next-token argmax is the target's, one token ahead). ``valid``: the
    held-out texts (None: ``train.valid_share`` of ``examples``, drawn with the seed)."""
    torch.manual_seed(train.seed)
    rng = random.Random(train.seed)
    gen = torch.Generator().manual_seed(train.seed)
    if valid is None:
        valid, fit = held_out_split(examples, train.valid_share, train.seed)
    else:
        fit = list(examples)
    bf16 = cpu_has_native_bf16() if train.bf16 is None else train.bf16
    rows = float_rows(model.lm_head, subset_ids(cfg, special_ids)).float()  # [S, H], frozen
    train_rows = rows.bfloat16() if bf16 else rows  # (autocast would cast the float rows again every window)
    if head is None:
        head = _initialized(cfg)
        with torch.no_grad():  # the features are the target's final norm's output: start from its scale
            head.norms["final_norm"].copy_(model.model.norm.scale().float())
    opt = torch.optim.AdamW(head.parameters(), lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.95))
    runs = _windows(fit, train.window)
    steps = max(1, math.ceil(len(runs) / train.accumulate) * train.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20))
                                              * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    report: dict = {"texts": len(fit), "held_out": len(valid), "tokens": sum(int(e.tokens.shape[0]) for e in fit),
                    "epochs": train.epochs, "steps": steps, "bf16": bf16}
    t0 = time.perf_counter()
    step = 0
    for epoch in range(train.epochs):
        rng.shuffle(runs)
        total, agree, count = 0.0, 0, 0
        for i in range(0, len(runs), train.accumulate):
            opt.zero_grad(set_to_none=True)
            batch = runs[i:i + train.accumulate]
            for ex, start, end in batch:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    pred, true, again = _run(head, model, ex, start, end, train.feature_noise, gen,
                                             train.second_step)
                    loss, ok = _loss(pred, true, train_rows, train.ce_weight)
                    if again is not None and again.shape[0]:
                        loss = loss + _loss(again, true[1:], train_rows, train.ce_weight)[0]
                (loss / len(batch)).backward()
                total += float(loss.detach()) * pred.shape[0]
                agree += int(ok)
                count += pred.shape[0]
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
        msg = (f"epoch {epoch + 1}/{train.epochs}: loss {total / max(1, count):.4f}, "
               f"agreement {agree / max(1, count):.3f}")
        if valid:
            report["held_out_agreement"] = held_out_agreement(head, model, valid, rows, train.window)
            msg += f", held out {report['held_out_agreement']:.3f}"
        log(f"{msg} ({time.perf_counter() - t0:.0f} s)")
    report["train_agreement"] = round(agree / max(1, count), 4)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return head, report


@torch.no_grad()
def held_out_agreement(head: EagleHead, model, examples: list[Example], rows: torch.Tensor,
                       window: int = 1024) -> float:
    """The share of positions where the head's argmax (one token ahead, from the target's features)
    is the target's own."""
    agree = count = 0
    for ex, start, end in _windows(examples, window):
        pred, true, _ = _run(head, model, ex, start, end, 0.0, None)
        agree += int(((pred @ rows.T).argmax(-1) == (true @ rows.T).argmax(-1)).sum())
        count += pred.shape[0]
    return round(agree / max(1, count), 4)


def _initialized(cfg: EagleConfig) -> EagleHead:
    """A new head: small random projections (the residual stream starts near fc's output)."""
    head = EagleHead(cfg)
    for name, lin in head.linears.items():
        torch.nn.init.normal_(lin.weight, std=0.02 if name != "fc" else 1.0 / math.sqrt(2 * cfg.hidden_size))
        if lin.bias is not None:
            torch.nn.init.zeros_(lin.bias)
    return head
