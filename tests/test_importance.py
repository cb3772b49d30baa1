"""Importance-weighted correction of Tool-ReRL (sec. 3.3, eq. 2; appendix A.3)."""
from __future__ import annotations

import math

import pytest
import torch

from reflrl.algos import clipped_policy_loss, get_policy_loss_fn
from reflrl.algos.importance import (
    rerl_importance_ratio,
    rerl_log_ratio,
    tool_rerl_policy_loss,
)
from reflrl.logprobs import sequence_logprobs
from reflrl.models import load_model
from reflrl.recovery.reflection import Attempt, augmented_messages

MSGS = [{"role": "system", "content": "You can call get_weather(city: str)."},
        {"role": "user", "content": "What's the weather in Paris?"}]
RESPONSES = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>']


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-random", dtype="float32", trainable="none", seed=0)
    model.eval()
    return model, tok


def _ids(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def response_logprobs(model, prompts, responses):
    """[B, L] log-probs of each response's tokens after its prompt (sequence_logprobs), aligned
    on response positions, and the [B, L] mask."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    lmax = max(len(r) for r in responses)
    b = len(prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    att = torch.zeros(b, width, dtype=torch.long)
    rm = torch.zeros(b, width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):  # right padding
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        att[i, : len(p) + len(r)] = 1
        rm[i, len(p): len(p) + len(r)] = 1
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, att, rm)
    out = torch.zeros(b, lmax)
    mask = torch.zeros(b, lmax, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        out[i, : len(r)] = lp[i, len(p): len(p) + len(r)]
        mask[i, : len(r)] = 1
    return out, mask


def hand_logprob(model, prompt, response):
    """log pi(response | prompt) from the full logits, written out by hand."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    total = 0.0
    for j, tok in enumerate(response):
        row = logits[len(prompt) + j - 1]
        total += float(row[tok] - torch.logsumexp(row, dim=-1))
    return total


def test_weight_equals_hand_computed_ratio_on_tiny_model(tiny):
    model, tok = tiny
    q = _ids(tok, MSGS)
    q_star = _ids(tok, augmented_messages(MSGS, [Attempt("", RESPONSES[1], "The call to `get_weather` is missing the argument 'city'.")]))
    assert len(q_star) > len(q)
    taus = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in RESPONSES]
    lp_q, mask = response_logprobs(model, [q, q], taus)
    lp_rfl, mask2 = response_logprobs(model, [q_star, q_star], taus)
    assert torch.equal(mask, mask2)
    w = rerl_importance_ratio(lp_q, lp_rfl, mask, level="sequence", log_cap=None)
    for i, tau in enumerate(taus):
        expected = math.exp(hand_logprob(model, q, tau) - hand_logprob(model, q_star, tau))
        got = w[i, mask[i].bool()]
        assert torch.allclose(got, torch.full_like(got, expected), rtol=1e-3), (got, expected)
        assert abs(math.log(expected)) > 1e-3  # the prompts really differ
        assert float(w[i, ~mask[i].bool()].abs().sum()) == 0.0
    # token level: one ratio per token, their product is the sequence ratio
    wt = rerl_importance_ratio(lp_q, lp_rfl, mask, level="token", log_cap=None)
    prod = torch.where(mask.bool(), wt, torch.ones_like(wt)).prod(-1)
    assert torch.allclose(prod, w[:, 0], rtol=1e-3)
    # the capped weight stays within [e^-cap, e^cap]
    wc = rerl_importance_ratio(lp_q, lp_rfl, mask, level="sequence", log_cap=0.01)
    assert float(wc[mask.bool()].max()) <= math.exp(0.01) + 1e-6
    assert float(wc[mask.bool()].min()) >= math.exp(-0.01) - 1e-6


@pytest.mark.parametrize("level", ["sequence", "token", "sequence_mean"])
def test_identical_prompts_weight_one_and_plain_clipped_loss(tiny, level):
    model, tok = tiny
    q = _ids(tok, MSGS)
    taus = [tok(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    lp_q, mask = response_logprobs(model, [q, q], taus)
    lp_rfl, _ = response_logprobs(model, [q, q], taus)  # q* == q
    w = rerl_importance_ratio(lp_q, lp_rfl, mask, level=level)
    assert torch.allclose(w[mask.bool()], torch.ones(int(mask.sum())), atol=1e-5)
    adv = torch.tensor([[1.5], [-0.7]]).expand_as(lp_q).contiguous()
    a = lp_q.clone().requires_grad_(True)
    b = lp_q.clone().requires_grad_(True)
    loss, metrics = tool_rerl_policy_loss(a, lp_rfl, adv, mask, level=level, clip_low=0.2, clip_high=0.2)
    ref, _ = clipped_policy_loss(b, lp_q, adv, mask, clip_low=0.2, clip_high=0.2)
    assert torch.allclose(loss, ref, atol=1e-6)
    loss.backward()
    ref.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert metrics["rerl/count"] == 2.0 and abs(metrics["rerl/weight_mean"] - 1.0) < 1e-5


def random_batch(seed=0, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    mask[:, 0] = 1
    return lp, old, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_rows_not_repaired_get_the_plain_clipped_loss(agg):
    lp, old, adv, mask = random_batch()
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss, _ = tool_rerl_policy_loss(a, old, adv, mask, repaired=torch.zeros(4, dtype=torch.bool),
                                    clip_low=0.2, clip_high=0.28, loss_agg_mode=agg)
    ref, _ = clipped_policy_loss(b, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg_mode=agg)
    assert torch.allclose(loss, ref, atol=1e-7)
    loss.backward()
    ref.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7)
    # token level with a cap wider than the data equals the plain loss too
    loss_t, _ = tool_rerl_policy_loss(lp, old, adv, mask, level="token", log_cap=20.0, clip_high=0.28)
    ref_t, _ = clipped_policy_loss(lp, old, adv, mask, clip_high=0.28)
    assert torch.allclose(loss_t, ref_t, atol=1e-7)


def seq_case(log_ratio: float, adv: float, t: int = 4, log_cap: float | None = 5.0):
    """One repaired row of t tokens whose trajectory log-ratio is ``log_ratio``; returns
    (loss, grad wrt the log-probs under q)."""
    beh = torch.full((1, t), -1.0)
    lp = (beh + log_ratio / t).clone().requires_grad_(True)
    mask = torch.ones(1, t, dtype=torch.long)
    loss, _ = tool_rerl_policy_loss(lp, beh, torch.full((1, t), adv), mask, level="sequence",
                                    log_cap=log_cap, clip_low=0.2, clip_high=0.2)
    loss.backward()
    return loss, lp.grad


def test_sequence_gradient_is_eq2_gradient_inside_the_clip_range():
    t = 4
    for lr, adv in [(-0.1, 1.0), (0.1, -2.0), (0.0, 0.5)]:
        loss, grad = seq_case(lr, adv, t)
        r = math.exp(lr)
        assert abs(float(loss.detach()) + adv * r) < 1e-5  # token-mean of -r*A over t equal tokens
        assert torch.allclose(grad, torch.full((1, t), -adv * r / t), atol=1e-6)


def test_clipping_bounds_the_gradient():
    t = 4
    # outside the clip range on the side eq. 2 clips: no gradient at all
    _, g = seq_case(math.log(1.5), +1.0, t)
    assert float(g.abs().max()) == 0.0
    _, g = seq_case(math.log(0.5), -1.0, t)
    assert float(g.abs().max()) == 0.0
    # the other sides are bounded by the cap: |grad| <= e^cap |A| / t for any ratio, 0 beyond it
    cap, adv = 5.0, -3.0
    for lr in [-100.0, -10.0, -1.0, 0.0, 1.0, 4.9, 5.1, 30.0, 100.0, 1000.0]:
        loss, g = seq_case(lr, adv, t, log_cap=cap)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert float(g.abs().max()) <= math.exp(cap) * abs(adv) / t + 1e-4
        if lr > cap:
            assert float(g.abs().max()) == 0.0
    # without a cap, float32 stays finite even for absurd log-ratios
    loss, g = seq_case(1e4, -1.0, t, log_cap=None)
    assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_masked_garbage_and_metrics():
    lp, old, adv, mask = random_batch(seed=3)
    lp = lp.masked_fill(mask == 0, float("nan"))
    old = old.masked_fill(mask == 0, float("-inf"))
    rep = torch.tensor([True, False, True, True])
    a = lp.clone().requires_grad_(True)
    loss, m = tool_rerl_policy_loss(a, old, adv, mask, repaired=rep)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()
    assert float(a.grad[mask == 0].abs().sum()) == 0.0
    mb = mask.bool()
    rows = [i for i in range(4) if rep[i]]
    lr = torch.stack([(torch.where(mb[i], lp[i], 0) - torch.where(mb[i], old[i], 0)).sum() for i in rows])
    w = lr.exp()
    assert m["rerl/count"] == 3.0
    assert abs(m["rerl/weight_mean"] - float(w.mean())) < 1e-4 * max(1.0, float(w.mean()))
    assert abs(m["rerl/weight_std"] - float(w.std(unbiased=False))) < 1e-4 * max(1.0, float(w.std()))
    assert abs(m["rerl/log_weight_mean"] - float(lr.mean())) < 1e-4
    assert 0.0 <= m["rerl/capped_frac"] <= 1.0


def test_log_ratio_levels_and_errors():
    lp = torch.tensor([[-1.0, -2.0, 0.0]])
    beh = torch.tensor([[-1.5, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(rerl_log_ratio(lp, beh, mask, "token"), torch.tensor([[0.5, -1.0, 0.0]]))
    assert torch.allclose(rerl_log_ratio(lp, beh, mask, "sequence"), torch.tensor([[-0.5, -0.5, 0.0]]))
    assert torch.allclose(rerl_log_ratio(lp, beh, mask, "sequence_mean"), torch.tensor([[-0.25, -0.25, 0.0]]))
    with pytest.raises(ValueError, match="level"):
        rerl_log_ratio(lp, beh, mask, "trajectory")
    with pytest.raises(ValueError, match="shape"):
        rerl_importance_ratio(lp, beh[:, :2], mask)
    with pytest.raises(ValueError, match="repaired"):
        tool_rerl_policy_loss(lp, beh, lp, mask, repaired=torch.ones(2, dtype=torch.bool))
    assert get_policy_loss_fn("tool_rerl") is tool_rerl_policy_loss
