"""reflrl.sft: the warm-up's learning-rate schedule anneals within its time budget."""
from __future__ import annotations

import itertools

import pytest

from reflrl import sft
from reflrl.models import load_model


def test_time_capped_warmup_still_anneals_its_learning_rate(monkeypatch):
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    ids = tok.encode("hello there")
    examples = [sft.SFTExample(ids, tok.encode(" ok") + [tok.eos_token_id], f"t{i}") for i in range(4)]
    clock = itertools.count(0.0, 1.0)  # every perf_counter() call advances one second
    monkeypatch.setattr(sft.time, "perf_counter", lambda: next(clock))
    lrs = []
    out = sft.train_sft(model, tok, examples, steps=1000, batch_size=2, lr=1e-3, time_budget_s=12.0,
                        log=lambda s, m: lrs.append(m["lr"]))
    assert 0 < out["steps"] < 1000  # the time budget ended it
    assert lrs == sorted(lrs, reverse=True)  # cosine decay, driven by time since steps barely moved
    assert lrs[-1] == pytest.approx(1e-4, rel=0.1)  # reached ~10% of lr when the budget ran out
    assert lrs[0] > 0.9e-3
