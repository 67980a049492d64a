"""Unseeded sampling with a draft head samples exactly the target's distribution: the 3-token
vocabulary's enumeration of test_layerskip_sampling.py, the draft now an (untrained, so often
rejected) head over the target's features. The same check rejects a head that reports a q other
than the one it drew from."""
from __future__ import annotations

import pytest
import torch

from tokenleap.heads.eagle import EagleConfig, EagleHead
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.eagle import EagleProposer
from tokenleap.spec.sampling import logits_to_probs

from test_layerskip_sampling import exact_distribution, p_value, sample_counts, target  # noqa: F401 (fixture)


def _proposer(model) -> EagleProposer:
    head = EagleHead(EagleConfig.for_target(model.config, subset=3))
    torch.manual_seed(7)
    for lin in head.linears.values():
        torch.nn.init.normal_(lin.weight, std=0.3)
    with torch.no_grad():
        head.norms["final_norm"].fill_(2.5)  # peaked q: a misreported one is far from it
    return EagleProposer(head, model, (), 32)


def test_eagle_sampling_matches_target_distribution(target, monkeypatch):  # noqa: F811
    counts, acceptance = sample_counts(target, 5, monkeypatch, _proposer(target))
    assert 0.05 < acceptance < 0.95  # the head's q differs from the target's p: rejections happen
    assert p_value(counts, exact_distribution(target)) > 1e-3


def test_same_check_rejects_a_head_misreporting_q(target, monkeypatch):  # noqa: F811
    choose = DraftModelProposer._choose

    def misreported(logits, params, generator, pos):
        token, _ = choose(logits, params, generator, pos)
        return token, logits_to_probs(logits, 3.0, 0, 1.0, 0.0)  # not the distribution the token came from

    monkeypatch.setattr(DraftModelProposer, "_choose", staticmethod(misreported))
    counts, _ = sample_counts(target, 5, monkeypatch, _proposer(target))
    assert p_value(counts, exact_distribution(target)) < 1e-6
