"""The training memory budget (reflrl.memory): the activation estimate bounds what autograd keeps, a batch
over the budget is split into micro-batches (warm-up NLL, RL update, the update's supervised anchor) and the
split gives the unsplit result. Chunked log-probs against full logits, values and gradients:
tests/test_logprobs.py (test_equals_naive_full_logits, test_gradients_match_naive_and_recompute)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from mapping import mapped_file, mapped_rss

from reflrl import config as C
from reflrl import rollout as R
from reflrl.envs.types import Task, ToolCall
from reflrl.logprobs import nll_backward, sequence_logprobs
from reflrl.memory import ActivationCost, budget_bytes, offload_optimizer_state, split_to_budget
from reflrl.models import load_model
from reflrl.sft import SFTExample, collate, sft_loss
from reflrl.train.batch import make_batch, micro_batches, update_bytes
from reflrl.train.step import policy_update


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", dtype="float32", trainable="all", seed=0)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_estimate_bounds_what_autograd_keeps(tiny):
    """The estimate is an upper bound of the saved activations (else a 'fitting' batch could exceed the
    budget) and not a gross overestimate (else batches are cut for nothing), at two lengths."""
    model, _ = tiny
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    cost = ActivationCost.of(model)
    for rows, width in [(2, 40), (3, 120)]:
        ids = torch.randint(3, 49152, (rows, width), generator=torch.Generator().manual_seed(width))
        am = torch.ones_like(ids)
        rm = torch.zeros_like(ids)
        rm[:, -4:] = 1  # few trained rows: the logits chunk is small, the decoder's activations dominate
        seen: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sequence_logprobs(model, ids, am, rm)
        saved = sum(seen.values())
        est = cost.forward_bytes(rows, width) + cost.logits
        assert saved <= est, (rows, width, saved, est)
        assert cost.forward_bytes(rows, width) <= 4 * saved, (rows, width, saved, est)


def test_frozen_layers_cost_nothing():
    model, _ = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    full, _ = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    assert ActivationCost.of(model).per_token * 2 == ActivationCost.of(full).per_token


def test_split_to_budget_is_greedy_in_order_and_never_drops():
    sizes = [5, 3, 4, 9, 1, 1]
    groups = split_to_budget(list(range(6)), lambda g: sum(sizes[i] for i in g), budget=8)
    assert groups == [[0, 1], [2], [3], [4, 5]]  # item 3 (9 > 8) runs alone: a sequence cannot be split
    assert split_to_budget(list(range(6)), lambda g: 0, budget=None, max_items=4) == [[0, 1, 2, 3], [4, 5]]
    assert [i for g in groups for i in g] == list(range(6))
    assert budget_bytes(None) is None and budget_bytes(1.5) == 3 << 19


def _examples(n=5):
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        p = torch.randint(3, 49152, (20 + 9 * k,), generator=g).tolist()
        a = torch.randint(3, 49152, (3 + k,), generator=g).tolist()
        out.append(SFTExample(p, a + [2]))
    return out


def test_nll_backward_splits_over_budget_and_equals_the_unsplit_loss(tiny):
    model, _ = tiny
    batch = collate(_examples(), pad_id=0)
    model.zero_grad(set_to_none=True)
    ref = sft_loss(model, batch)
    ref.backward()
    want = _grads(model)
    cost = ActivationCost.of(model)
    widest = int(batch["attention_mask"].sum(-1).max())
    budget = cost.forward_bytes(2, widest) + cost.logits  # two rows fit, not five
    for b, parts in [(None, 1), (budget, 3)]:
        model.zero_grad(set_to_none=True)
        loss, n = nll_backward(model, batch, b, scale=2.0)
        assert n == parts
        assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-5)
        got = _grads(model)
        for k in want:
            assert torch.allclose(got[k], 2.0 * want[k], atol=1e-6), k


def _update_batch(tok, n_prompts=2, n=4):
    trajs = []
    for gi in range(n_prompts):
        task = Task(id=f"t{gi}", query="q", tools=[], gold=[[ToolCall("f", {})]])
        prompt = tok(f"call f please, prompt {gi} " * (3 + 2 * gi), add_special_tokens=False)["input_ids"]
        for k in range(n):
            t = R.Trajectory(task=task, group=gi, prompt_ids=prompt, reward=float(k % 2))
            ids = tok(f"answer {k} " * (k + 2), add_special_tokens=False)["input_ids"]
            t.append_action(ids, [-1.0] * len(ids))
            trajs.append(t)
    adv = [1.0 if t.reward else -1.0 for t in trajs]
    return make_batch(trajs, adv, tok.pad_token_id or 0)


def test_update_micro_batches_fit_the_budget(tiny):
    model, tok = tiny
    batch = _update_batch(tok)
    cost = ActivationCost.of(model)
    plain = micro_batches(batch, 8)
    assert len(plain) == 1
    one = max(update_bytes(cost, [len(mb.prompts[0])], [0], [int(mb.resp_attn.sum(-1).max())]) for mb in plain)
    budget = cost.logits + 3 * (one - cost.logits) // 2  # room for about one row and a half of activations
    split = micro_batches(batch, 8, budget, cost)
    assert len(split) > 2
    assert sum(len(mb) for mb in split) == len(batch)
    for mb in split:
        owners = mb.owner.tolist()
        need = update_bytes(cost, [len(mb.prompts[o]) for o in owners], owners, mb.resp_attn.sum(-1).tolist())
        assert need <= budget or len(mb) == 1


@pytest.mark.parametrize("with_demos", [False, True])
def test_policy_update_split_by_the_budget_equals_the_unsplit_update(with_demos):
    """The same batch, once unbounded (one micro-batch) and once under a budget that forces micro-batches:
    the same loss and the same parameter change (SGD with lr 1: the change is the gradient), also with the
    supervised anchor on demonstrations (its own backward, split by the same budget)."""
    results = []
    for mb_budget in (None, 0.0005):  # 0.5 KB: every row alone
        model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        a = C.AlgoConfig(micro_batch_size=8, grad_clip=0.0, activation_budget_mb=mb_budget,
                         sft_coef=0.5 if with_demos else 0.0)
        demos = collate(_examples(3), pad_id=0) if with_demos else None
        m = policy_update(model, opt, _update_batch(tok), a, demos=demos)
        delta = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        results.append((m, delta))
    (m0, d0), (m1, d1) = results
    assert m0["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
    if with_demos:
        assert m0["sft_loss"] == pytest.approx(m1["sft_loss"], rel=1e-5)
    for k in d0:
        assert torch.allclose(d0[k], d1[k], atol=1e-6), k
    assert any(float(d.abs().max()) > 0 for d in d0.values())


def test_the_heap_is_given_back_after_every_micro_batch_of_an_update(monkeypatch):
    """Micro-batches of different shapes leave their freed activations in the C heap, fragmented; the
    update trims it after each one's backward pass, so the next starts on what the process really holds
    (and the optimiser step reads AdamW's moments into freed memory)."""
    import reflrl.train.step as S

    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = _update_batch(tok)
    events: list[str] = []
    monkeypatch.setattr(S, "release_heap", lambda: events.append("trim") or True)
    real = S.batch_logprobs
    monkeypatch.setattr(S, "batch_logprobs", lambda *a, **k: events.append("forward") or real(*a, **k))
    a = C.AlgoConfig(micro_batch_size=2, grad_clip=0.0)  # 8 rows: 4 micro-batches
    policy_update(model, opt, batch, a)
    assert events == ["forward", "trim"] * 4 + ["trim"]  # and once more after the optimiser step


def test_fixed_batches_take_as_many_prompts_as_the_kv_budget_holds(tiny):
    """The fixed-batch path sizes its batches to ``kv_budget_bytes`` (rows x (longest prompt + cap) x bytes
    per token), at least one prompt, and greedy answers are the same whatever the batch size."""
    from reflrl.engines.continuous import kv_bytes_per_token
    from reflrl.engines.transformers_engine import TransformersEngine

    model, tok = tiny
    prompts = [tok(f"question number {i} " * (1 + i % 3), add_special_tokens=False)["input_ids"] for i in range(6)]
    caps = [8] * len(prompts)
    per_row = kv_bytes_per_token(model) * (max(len(p) for p in prompts) + 8)
    free = TransformersEngine(model, tok, max_batch_size=64)
    tight = TransformersEngine(model, tok, max_batch_size=64, kv_budget_bytes=2 * per_row + 1)
    assert free.prompts_per_batch(prompts, caps, 1) == 64
    assert tight.prompts_per_batch(prompts, caps, 1) == 2
    assert tight.prompts_per_batch(prompts, caps, 2) == 1
    assert TransformersEngine(model, tok, kv_budget_bytes=1).prompts_per_batch(prompts, caps, 1) == 1
    a = free.generate(prompts, n=1, max_new_tokens=8, temperature=0.0)
    b = tight.generate(prompts, n=1, max_new_tokens=8, temperature=0.0)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_optimizer_state_offloaded_to_a_mapped_file_steps_the_same(tmp_path, monkeypatch):
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    assert not offload_optimizer_state(opts[1], tmp_path)  # no state yet: nothing to move

    def step(m, opt, x):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()

    xs = [torch.randn(3, 8) for _ in range(3)]
    for m, o in zip((a, b), opts):
        step(m, o, xs[0])
    assert offload_optimizer_state(opts[1], tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked once mapped: nothing left behind
    moments = [s[k] for s in opts[1].state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert all(".mapped-" in mapped_file(t) for t in moments)  # read from the mapping, not the heap
    for x in xs[1:]:  # the next steps update the mapped moments (copy-on-write) as they would the heap's
        for m, o in zip((a, b), opts):
            step(m, o, x)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for sa, sb in zip(opts[0].state.values(), opts[1].state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert list(tmp_path.iterdir()) == []

    import reflrl.diskspace as D  # a disk without room: nothing moves, nothing is lost
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: type("U", (), {"free": 0})())
    fresh = torch.optim.AdamW(a.parameters(), lr=1e-2)
    step(a, fresh, xs[0])
    kept = [s["exp_avg"].clone() for s in fresh.state.values()]
    assert not offload_optimizer_state(fresh, tmp_path) and list(tmp_path.iterdir()) == []
    assert all(".mapped-" not in mapped_file(s["exp_avg"]) and torch.equal(s["exp_avg"], k)
               for s, k in zip(fresh.state.values(), kept))


def test_peak_memory_is_measured_per_phase_and_nested_phases_count_for_both():
    """PeakMemory resets the kernel's high-water mark at each phase: a phase that allocated 200 MB reads at
    least that much above the process's resident memory, a later phase that allocated nothing reads less,
    and a phase inside another (a probe inside the warm-up) counts for both."""
    from reflrl.memory import PeakMemory, peak_rss_bytes, release_heap, reset_peak_rss

    peaks: dict[str, float] = {}
    pm = PeakMemory(peaks)
    release_heap()
    assert reset_peak_rss()
    base = peak_rss_bytes() / 1e6  # resident now (the mark restarts at the current resident memory)

    def touch(mb):
        x = torch.ones(int(mb * 1e6) // 4)
        x += 1
        del x
        # a large block may come from a free chunk of the heap (earlier tests fragment it) rather than
        # from its own mapping: trimmed, as the run does after its phases, its pages leave either way
        release_heap()

    with pm.phase("big"):
        touch(200)
    with pm.phase("small"):
        touch(1)
    with pm.phase("outer"):
        with pm.phase("inner"):
            touch(150)
    assert pm.per_phase  # Linux: /proc/self/clear_refs restarts the mark
    assert peaks["big"] >= base + 190
    assert peaks["small"] < peaks["big"] - 150
    assert peaks["inner"] >= peaks["small"] + 140 and peaks["outer"] >= peaks["inner"]
    with pm.phase("small"):  # a phase that runs again keeps the larger of its peaks
        touch(100)
    assert peaks["small"] >= base + 90


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT) and /proc/self/smaps are Linux's")
def test_mapped_pages_read_once_are_given_back_with_their_values_kept(tmp_path):
    """Tensors map_to_disk returned, read whole, are resident; release_mapped_pages gives their pages back
    (the mapping's resident size drops) and a later read finds the same values."""
    from reflrl.memory import map_to_disk, release_mapped_pages

    data = [torch.randn(1024, 1024), torch.randn(512, 1024)]  # 6 MB
    mapped = map_to_disk([t.clone() for t in data], tmp_path, "test tensors", 6 << 20)
    assert mapped is not None and ".mapped-" in mapped_file(mapped[0])
    os.sync()  # the file's pages written back (a run reads them back minutes later; dirty pages stay)
    assert all(torch.equal(a, b) for a, b in zip(mapped, data))  # read: now resident
    assert mapped_rss(mapped[0]) >= 6 << 20
    if not release_mapped_pages(mapped):
        pytest.skip("this kernel has no MADV_PAGEOUT (before 5.4)")
    assert mapped_rss(mapped[0]) <= 1 << 20
    assert all(torch.equal(a, b) for a, b in zip(mapped, data))  # the same values, read back from the file


def _saved_bytes(model, ids):
    """Bytes of the tensors autograd keeps for the backward pass of a forward over ``ids`` (parameters
    not counted), and the loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids).logits.float().log_softmax(-1)[:, -5:, :50].mean()
    return sum(v for k, v in seen.items() if k not in params), loss


def _plain_mlps(model):
    for layer in model.get_decoder().layers:
        if getattr(layer.mlp, "lean_activations", False):
            del layer.mlp.forward  # back to the class's forward
            layer.mlp.lean_activations = False


@pytest.mark.parametrize("dtype,trainable,trained", [("float32", "all", 2), ("bfloat16", "top_layers:1", 1)])
def test_trained_mlps_keep_gate_and_up_only_with_autograds_gradients(dtype, trainable, trained):
    """A trained MLP keeps two intermediate-size tensors per token fewer than autograd's own (its SiLU and
    the gated product are recomputed in the backward pass) and gives the same gradients, bit for bit;
    sampling (no gradients) and frozen layers run the module's own forward."""
    lean, _ = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    plain, _ = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    _plain_mlps(plain)
    layers = lean.get_decoder().layers
    assert sum(getattr(layer.mlp, "lean_activations", False) for layer in layers) == trained
    ids = torch.randint(0, 1000, (3, 17), generator=torch.Generator().manual_seed(0))
    kept_lean, loss_lean = _saved_bytes(lean, ids)
    kept_plain, loss_plain = _saved_bytes(plain, ids)
    size = next(p for p in lean.parameters() if p.requires_grad).element_size()
    assert kept_plain - kept_lean == 2 * lean.config.intermediate_size * ids.numel() * trained * size
    assert torch.equal(loss_lean, loss_plain)
    loss_lean.backward()
    loss_plain.backward()
    assert _grads(lean).keys() == _grads(plain).keys()
    for k, g in _grads(lean).items():
        assert torch.equal(g, _grads(plain)[k]), k
    with torch.no_grad():
        assert torch.equal(lean(input_ids=ids).logits, plain(input_ids=ids).logits)
    cost_lean, cost_plain = ActivationCost.of(lean), ActivationCost.of(plain)
    assert cost_plain.per_token > cost_lean.per_token


def test_a_copy_of_a_model_with_lean_mlps_computes_with_its_own_weights():
    """A deep copy (the KL reference is one) keeps the lean forward bound to its own modules: changing the
    original's weights changes nothing in the copy, with or without gradients."""
    import copy

    model, _ = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    before = ref(input_ids=ids).logits.detach()
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            layer.mlp.down_proj.weight.mul_(3.0)
    assert torch.equal(ref(input_ids=ids).logits.detach(), before)
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, before)
    assert not torch.equal(model(input_ids=ids).logits.detach(), before)


def test_lora_mlps_keep_their_forward():
    model, _ = load_model("tiny-random", dtype="float32", trainable="lora", seed=0)
    assert not any(getattr(m, "lean_activations", False) for m in model.modules())
