"""Training data for draft heads: long texts cut into training windows, features kept on disk per
source (read back, recomputed for other texts, another precision or a damaged file), and the
held-out set a caller names kept out of training."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenleap.heads.eagle import EagleConfig
from tokenleap.heads.features import FeatureStore, collect_features, text_pieces
from tokenleap.heads.train import TrainConfig, held_out_split, train_head

from conftest import tiny_model


def _model():
    return tiny_model("qwen2", seed=4, vocab=96, hidden=64, intermediate=128, layers=4)


def test_text_pieces_cover_every_pair_once():
    ids = list(range(10, 33))  # 23 tokens: 22 pairs (x_t, x_{t+1})
    pieces = text_pieces(ids, 8)
    assert all(len(p) <= 9 for p in pieces)
    pairs = [(p[i], p[i + 1]) for p in pieces for i in range(len(p) - 1)]
    assert pairs == list(zip(ids, ids[1:]))  # consecutive pieces share one token: no pair lost or doubled
    assert text_pieces([1, 2], 8) == [[1, 2]] and text_pieces(list(range(9)), 8) == [list(range(9))]


def test_feature_store_reads_back_and_recomputes_what_changed(tmp_path):
    model = _model()
    logs: list[str] = []
    target = SimpleNamespace(source="tiny", dtype=torch.float32, quant="none")
    store = FeatureStore(tmp_path, target, logs.append)
    seqs = [[5, 6, 7, 8, 9], [3, 4, 5], [1, 2]]  # the last is too short to train on: dropped
    first = store.get(model, seqs, "a")
    assert [e.tokens.tolist() for e in first] == seqs[:2] and "computing" in logs[-1]
    assert torch.equal(first[0].feats, collect_features(model, seqs[:1])[0].feats)
    again = store.get(model, seqs, "a")
    assert "features read from" in logs[-1]
    assert all(torch.equal(a.feats, b.feats) for a, b in zip(first, again))
    store.get(model, [[5, 6, 7, 8]], "b")  # other tokens: their own file
    assert "computing" in logs[-1] and len(list(tmp_path.glob("*.pt"))) == 2
    other = FeatureStore(tmp_path, SimpleNamespace(source="tiny", dtype=torch.float32, quant="int4"), logs.append)
    assert other.path(seqs[:2]) != store.path(seqs[:2])  # another precision: other features
    store.path(seqs[:2]).write_bytes(b"not a tensor file")
    assert [e.tokens.tolist() for e in store.get(model, seqs, "a")] == seqs[:2]
    assert any(line.startswith("ignoring") for line in logs) and "computing" in logs[-1]


def test_a_named_held_out_set_is_not_trained_on():
    model = _model()
    examples = collect_features(model, [list(range(3 + i, 30 + i)) for i in range(12)])
    valid, fit = held_out_split(examples, 0.25)
    assert len(valid) == 3 and len(fit) == 9 and not {id(e) for e in valid} & {id(e) for e in fit}
    cfg = EagleConfig.for_target(model.config, subset=96)
    _, report = train_head(model, fit, cfg, train=TrainConfig(epochs=1, accumulate=2), valid=valid)
    assert report["texts"] == 9 and report["held_out"] == 3 and "held_out_agreement" in report
    _, report = train_head(model, fit, cfg, train=TrainConfig(epochs=1, accumulate=2), valid=[])
    assert report["texts"] == 9 and report["held_out"] == 0 and "held_out_agreement" not in report


def test_a_feature_store_killed_mid_save_leaves_nothing_behind(tmp_path):
    """A run killed while saving features leaves its temp file (up to a gigabyte): the next store in
    that directory removes it once its writer is gone and it is old, and leaves a live writer's alone."""
    import os
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"0123456789abcdef01234567.pt.t7.{dead.pid}.tmp"
    live = tmp_path / f"89abcdef0123456789abcdef.pt.t7.{os.getpid()}.tmp"
    for f in (orphan, live):
        f.write_bytes(b"x" * 100)
        os.utime(f, (1, 1))  # (old)
    store = FeatureStore(tmp_path, SimpleNamespace(source="tiny", dtype=torch.float32, quant="none"))
    store.get(_model(), [[5, 6, 7, 8, 9]], "a")
    assert not orphan.exists() and live.exists() and len(list(tmp_path.glob("*.pt"))) == 1
