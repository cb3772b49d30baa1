"""Tests of reflrl.logprobs.sequence_logprobs against the naive full-logits computation."""

from __future__ import annotations

import pytest
import torch

from reflrl.logprobs import position_ids_from_mask, sequence_logprobs, token_logprobs_from_hidden
from reflrl.models import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", dtype="float32", seed=0)


def _batch(padding: str):
    g = torch.Generator().manual_seed(0)
    lens, width = [12, 7, 10], 12
    ids = torch.zeros(3, width, dtype=torch.long)
    am, rm = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, n in enumerate(lens):
        sl = slice(0, n) if padding == "right" else slice(width - n, width)
        ids[i, sl] = torch.randint(3, 49152, (n,), generator=g)
        am[i, sl] = 1
        idx = torch.arange(width)[sl]
        rm[i, idx[3:]] = 1  # first 3 real tokens are "prompt"
        rm[i, idx[5]] = 0  # an "observation" token in the middle
    return ids, am, rm


def _naive(model, ids, am, rm, temperature=1.0):
    logits = model(
        input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)
    ).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.zeros(ids.shape, dtype=torch.float32)
    out[:, 1:] = lp * (rm[:, 1:] * am[:, 1:])
    return out


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_equals_naive_full_logits(tiny, padding, temperature):
    model, _ = tiny
    ids, am, rm = _batch(padding)
    with torch.no_grad():
        got = sequence_logprobs(model, ids, am, rm, temperature=temperature, chunk_size=4)
        want = _naive(model, ids, am, rm, temperature)
    assert torch.allclose(got, want, atol=1e-5)
    assert (got[rm == 0] == 0).all() and (got[rm == 1] < 0).all()


def test_position_zero_and_empty_mask_give_zeros(tiny):
    model, _ = tiny
    ids, am, _ = _batch("right")
    rm = torch.zeros_like(ids)
    rm[:, 0] = 1  # nothing precedes position 0
    with torch.no_grad():
        assert (sequence_logprobs(model, ids, am, rm) == 0).all()


def test_shape_mismatch_is_an_error(tiny):
    model, _ = tiny
    ids, am, rm = _batch("right")
    with pytest.raises(ValueError, match="shape mismatch"):
        sequence_logprobs(model, ids, am, rm[:, :-1])


def test_gradients_match_naive_and_recompute(tiny):
    model, _ = tiny
    ids, am, rm = _batch("right")
    grads = []
    for fn in (
        lambda: _naive(model, ids, am, rm),
        lambda: sequence_logprobs(model, ids, am, rm, chunk_size=4, recompute=False),
        lambda: sequence_logprobs(model, ids, am, rm, chunk_size=4, recompute=True),
    ):
        model.zero_grad(set_to_none=True)
        fn().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for g in grads[1:]:
        for n in g:
            assert torch.allclose(g[n], grads[0][n], atol=1e-5), n


def test_gradient_flows_only_to_trainable_params():
    model, _ = load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1", seed=0)
    ids, am, rm = _batch("right")
    lp = sequence_logprobs(model, ids, am, rm)
    assert lp.dtype == torch.float32 and lp.requires_grad
    lp.sum().backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_masked_tokens_get_no_gradient(tiny):
    """Changing a token that is neither in the response nor before one leaves the loss unchanged;
    the log-prob of masked (observation) positions contributes nothing."""
    model, _ = tiny
    ids, am, rm = _batch("right")
    rm2 = rm.clone()
    rm2[0, 8] = 0
    with torch.no_grad():
        a = sequence_logprobs(model, ids, am, rm)
        b = sequence_logprobs(model, ids, am, rm2)
    assert b[0, 8] == 0 and a[0, 8] != 0
    mask = torch.ones_like(a, dtype=torch.bool)
    mask[0, 8] = False
    assert torch.equal(a[mask], b[mask])


def test_token_logprobs_from_hidden_handles_empty_and_chunks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g)
    h = torch.randn(7, 8, generator=g)
    t = torch.randint(0, 50, (7,), generator=g)
    ref = torch.log_softmax(h @ w.T, -1).gather(-1, t[:, None]).squeeze(-1)
    assert torch.allclose(token_logprobs_from_hidden(h, t, w, chunk_size=3), ref, atol=1e-6)
    assert token_logprobs_from_hidden(h[:0], t[:0], w).shape == (0,)


def test_logprobs_and_values_one_pass(tiny):
    from reflrl.logprobs import ValueHead, hidden_states, sequence_logprobs_and_values

    model, _ = tiny
    ids, am, rm = _batch("right")
    head = ValueHead(model.config.hidden_size)
    with torch.no_grad():
        head.proj.weight.normal_(0, 1.0)
        head.proj.bias.fill_(0.5)
        lp, v = sequence_logprobs_and_values(model, head, ids, am, rm)
        assert torch.equal(lp, sequence_logprobs(model, ids, am, rm))
        h = hidden_states(model, ids, am)
    # values[b, t] = head(h[b, t-1]) at response positions, 0 elsewhere
    want = torch.zeros_like(v)
    want[:, 1:] = head(h[:, :-1]) * (rm[:, 1:] * am[:, 1:])
    assert torch.allclose(v, want, atol=1e-6)
    assert (v[rm == 0] == 0).all()
    # the value loss reaches the head and the trunk
    model.zero_grad(set_to_none=True)
    _, v = sequence_logprobs_and_values(model, head, ids, am, rm)
    (v ** 2).sum().backward()
    assert head.proj.weight.grad is not None and head.proj.weight.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_value_head_starts_at_zero():
    from reflrl.logprobs import ValueHead

    assert torch.equal(ValueHead(8)(torch.randn(3, 5, 8)), torch.zeros(3, 5))


def test_activation_checkpointing_with_mixed_top_layers_gives_same_grads():
    ids, am, rm = _batch("right")
    grads = []
    for ckpt in (False, True):
        model, _ = load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1", seed=0)
        if ckpt:
            model.gradient_checkpointing_enable()
        sequence_logprobs(model, ids, am, rm).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert grads[1][n] is not None and torch.allclose(grads[0][n], grads[1][n], atol=1e-5), n


def _grouped(n: int = 3):
    """Two prompts (lengths 5 and 8) x n suffixes of different lengths, as grouped + flat batches."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (k,), generator=g).tolist() for k in (5, 8)]
    sufs = [torch.randint(3, 49152, (2 + (i % 3) * 2,), generator=g).tolist() for i in range(2 * n)]
    P, S = 8, max(map(len, sufs))
    pid, pm = torch.zeros(2, P, dtype=torch.long), torch.zeros(2, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        pid[i, P - len(p):] = torch.tensor(p)
        pm[i, P - len(p):] = 1
    sid, sm = torch.zeros(2 * n, S, dtype=torch.long), torch.zeros(2 * n, S, dtype=torch.long)
    for i, q in enumerate(sufs):
        sid[i, : len(q)] = torch.tensor(q)
        sm[i, : len(q)] = 1
    rmask = sm.clone()
    rmask[:, 1] = 0  # an observation token inside the suffix
    full = [prompts[i // n] + sufs[i] for i in range(2 * n)]
    W = max(map(len, full))
    fid, fam, frm = (torch.zeros(2 * n, W, dtype=torch.long) for _ in range(3))
    for i, q in enumerate(full):
        pl = len(prompts[i // n])
        fid[i, : len(q)] = torch.tensor(q)
        fam[i, : len(q)] = 1
        frm[i, pl : len(q)] = rmask[i, : len(sufs[i])]
    return (pid, pm, sid, sm, rmask), (fid, fam, frm), [len(prompts[i // n]) for i in range(2 * n)]


def test_shared_prefix_equals_full_sequences_values_and_grads():
    from reflrl.logprobs import shared_prefix_logprobs

    n = 3
    (pid, pm, sid, sm, rmask), (fid, fam, frm), plens = _grouped(n)
    model, _ = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    a = shared_prefix_logprobs(model, pid, pm, sid, sm, rmask, n, temperature=0.8)
    a.sum().backward()
    ga = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    b = sequence_logprobs(model, fid, fam, frm, temperature=0.8)
    b.sum().backward()
    for i, pl in enumerate(plens):
        k = int(sm[i].sum())
        assert torch.allclose(a[i, :k], b[i, pl : pl + k], atol=1e-5)
        assert (a[i, k:] == 0).all()
    assert (a[rmask == 0] == 0).all() and (a[rmask == 1] < 0).all()
    for k, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(ga[k], p.grad, atol=1e-5), k
    with pytest.raises(ValueError, match="shape mismatch"):
        shared_prefix_logprobs(model, pid, pm, sid, sm, rmask, n + 1)
