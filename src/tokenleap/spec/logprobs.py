"""Log-probabilities of chosen tokens and their most likely alternatives, from the target's raw
logits (before penalties, temperature and top-k / top-p: what vLLM reports by default).

In a speculative step the logits of every emitted token come from the same verification forward
that chose it, and that forward's rows are bitwise those of plain decoding, so a token's reported
log-probability does not depend on how it was proposed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens, best first
    rank: int = 1  # 1 + the number of tokens more likely than this one (vLLM's "rank")

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [list(t) for t in self.top]}


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab]: row i is the distribution token i was chosen from
    tokens: list[int],  # n chosen tokens
    num_top: int,  # alternatives per token (0: only the chosen token's)
) -> list[TokenLogprob]:
    assert logits.dim() == 2 and logits.shape[0] == len(tokens), (
        f"need one logits row per token: {tuple(logits.shape)} for {len(tokens)} tokens")
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])  # [n, 1]
    ranks = ((lp > chosen).sum(-1) + 1).tolist()  # [n]
    chosen = chosen[:, 0].tolist()  # [n]
    if num_top > 0:
        values, indices = lp.topk(min(num_top, lp.shape[-1]), dim=-1)  # [n, num_top] each
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, top, r) for t, c, top, r in zip(tokens, chosen, tops, ranks)]


__all__ = ["TokenLogprob", "token_logprobs"]
