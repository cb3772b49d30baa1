"""Trainer efficiency benchmarks, measured in one run on this machine (issue 3 acceptance).

    .venv/bin/python scripts/bench_train.py [--model smollm2-135m-instruct] [--repeats 3]

(a) policy-update time per step with max-variance down-sampling m = n/2 vs all n rollouts
    (efficiency paper, arXiv:2606.00135, sec. 4.2; target: speed-up >= 0.8 x the ideal 2x);
(b) share of prompts skipped by the online pre-rollout filter per epoch (efficiency paper, arXiv:2606.00135, sec. 4.1, k=1),
    on a simulated policy whose per-prompt success probabilities rise over training (and, with
    --run RUN_DIR, the skips a real run recorded);
(c) training-step overhead over a bare transformers forward+backward(+AdamW step) on the same
    tokens (target <= 1.25x);
(d) rollout wall time with concurrent episodes vs one-at-a-time tool calls, 200 ms tool latency
    (VerlTool sec. 3.3, Table 3 reports 1.22-1.97x; target >= 2x): with the warmed-up policy
    (single- and multi-turn; on a CPU its generation dominates), and with a gold-answer replay engine
    that takes generation out and measures the environment side alone.

Everything runs in this process, sequentially; each figure is a ratio of two timings taken back to
back on the same inputs (median of --repeats).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def build(model_name: str, trainable: str, dtype: str):
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.models import load_model

    model, tok = load_model(model_name, dtype=dtype, trainable=trainable)
    return model, tok, TransformersEngine(model, tok, max_batch_size=64)


def real_trajectories(engine, tok, tasks, n, max_new_tokens, style="compact"):
    """B x n single-turn rollouts against the real env (no faults)."""
    import gymnasium as gym

    import reflrl.envs  # noqa: F401
    from reflrl import rollout as R

    envs = [gym.make("reflrl/ToolCall-v0", dataset=tasks, seed=k, prompt_style=style).unwrapped
            for k in range(len(tasks) * n)]
    cfg = R.RolloutSpec(max_new_tokens=max_new_tokens, temperature=1.0)
    loop = asyncio.new_event_loop()
    trajs = loop.run_until_complete(R.arollout(engine, tok, envs, tasks, n, cfg, seed=1))
    for e in envs:
        loop.run_until_complete(e.aclose())
    loop.close()
    return trajs


# ------------------------------------------------------------------------------------------ (a)
def bench_downsample(model, tok, trajs, n, repeats):
    from reflrl import config as C
    from reflrl.train.batch import make_batch
    from reflrl.train.step import policy_update
    from reflrl.algos import max_variance_subset

    a = C.AlgoConfig(micro_batch_size=8, lr=1e-6)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    groups = [trajs[i: i + n] for i in range(0, len(trajs), n)]
    # binary rewards with both classes in every group (what eq. 7 down-samples); alternate if the
    # sampled ones happen to be uniform, so both runs train the same kind of batch
    for g in groups:
        for j, t in enumerate(g):
            t.reward = float(j % 2 == 0) if len({x.reward for x in g}) < 2 else t.reward
    full = [t for g in groups for t in g]
    half = [g[i] for g in groups for i in max_variance_subset([t.reward for t in g], n // 2)]
    adv_full = [1.0 if t.reward > 0 else -1.0 for t in full]
    adv_half = [1.0 if t.reward > 0 else -1.0 for t in half]
    b_full = make_batch(full, adv_full, tok.pad_token_id)
    b_half = make_batch(half, adv_half, tok.pad_token_id)
    out = {}
    for share in (False, True):
        policy_update(model, opt, b_half, a, share_prompt=share)  # warm-up
        t_full = median_time(lambda: policy_update(model, opt, b_full, a, share_prompt=share), repeats)
        t_half = median_time(lambda: policy_update(model, opt, b_half, a, share_prompt=share), repeats)
        speed = t_full / t_half
        how = "prompt once per group" if share else "full sequences (the paper's setting)"
        print(f"(a) update per step, {how}: all n={n}: {t_full:.2f}s ({len(full)} seq, {b_full.n_tokens} tok); "
              f"m=n/2: {t_half:.2f}s ({len(half)} seq) -> speed-up {speed:.2f}x = {speed / 2:.2f} of the ideal 2x "
              f"(target >= 0.80) {'OK' if speed / 2 >= 0.8 else 'MISSED'}")
        out["shared_prompt" if share else "full_sequences"] = {
            "update_full_s": t_full, "update_half_s": t_half, "speedup": speed, "fraction_of_ideal": speed / 2}
    return out


# ------------------------------------------------------------------------------------------ (b)
def bench_prefilter(run_dir: str | None, epochs: int = 6, prompts: int = 256, n: int = 8, k: int = 1):
    """Simulated policy: prompt i is solved with probability p_i(e) = sigmoid(a_i + 0.8 e), a_i ~ N(0, 2)
    (a spread of easy and hard prompts that all get easier); n rollouts per prompt; the filter of
    efficiency paper (arXiv:2606.00135) eqs. 4-6 with k."""
    from reflrl.algos import PreRolloutFilter

    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 2.0, prompts)
    f = PreRolloutFilter(k)
    shares = []
    for e in range(epochs):
        ids = [f"p{i}" for i in range(prompts)]
        kept = f.keep(ids, epoch=e)
        for pid in kept:
            i = int(pid[1:])
            p = 1 / (1 + np.exp(-(a[i] + 0.8 * e)))
            f.update(pid, (rng.random(n) < p).astype(float).tolist(), r_max=1.0)
        shares.append(f.skip_ratio(e))
    print(f"(b) pre-rollout filter (k={k}, simulated policy, {prompts} prompts x {n} rollouts): skipped per epoch "
          + ", ".join(f"e{e}={s:.0%}" for e, s in enumerate(shares)))
    out = {"simulated_skip_share_per_epoch": shares}
    if run_dir:
        s = json.loads((Path(run_dir) / "summary.json").read_text())
        real = s.get("prefilter_skipped_per_epoch", {})
        print(f"    real run {run_dir}: prompts skipped per epoch {real}")
        out["run_skipped_per_epoch"] = real
    return out


# ------------------------------------------------------------------------------------------ (c)
def bench_overhead(model, tok, trajs, repeats):
    """Our step (policy_update: log-probs at response positions only, clipped loss, backward, AdamW)
    vs a bare transformers step on the same sequences: model(input_ids) with full logits,
    advantage-weighted log-likelihood of the response tokens, backward, AdamW. Ours is timed with
    the prompt computed once per group (the default) and with full sequences like the bare step."""
    from reflrl import config as C
    from reflrl.train.batch import make_batch
    from reflrl.train.step import policy_update

    a = C.AlgoConfig(micro_batch_size=len(trajs), lr=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    adv = [1.0 if i % 2 else -1.0 for i in range(len(trajs))]
    batch = make_batch(trajs, adv, tok.pad_token_id)
    ids, attn, resp = batch.full()
    adv_full = batch.to_full(batch.advantages)

    def ours(share=True):
        policy_update(model, opt, batch, a, share_prompt=share)

    def bare():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=attn)
        logits = out.logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = resp[:, 1:].float()
        loss = -(lp * adv_full[:, 1:] * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ours(), ours(False), bare()  # warm-up
    t_ours = median_time(ours, repeats)
    t_full = median_time(lambda: ours(False), repeats)
    t_bare = median_time(bare, repeats)
    r, r_full = t_ours / t_bare, t_full / t_bare
    print(f"(c) training step on {len(trajs)} seq / {batch.n_tokens} tokens: bare transformers forward+backward+AdamW "
          f"{t_bare:.2f}s; reflrl {t_ours:.2f}s -> {r:.2f}x (prompt once per group), {t_full:.2f}s -> {r_full:.2f}x "
          f"(full sequences) (target <= 1.25) {'OK' if max(r, r_full) <= 1.25 else 'MISSED'}")
    return {"reflrl_step_s": t_ours, "reflrl_full_seq_step_s": t_full, "bare_step_s": t_bare, "ratio": r,
            "ratio_full_seq": r_full}


# ------------------------------------------------------------------------------------------ (d)
class GoldReplayEngine:
    """A RolloutEngine that answers each task's prompt with its gold calls at once (no model): with
    generation out of the way, (d) with this engine measures the environment side alone -- how much
    of the tool latency concurrent episodes hide. Used only in this benchmark, and labelled so."""

    def __init__(self, tok, tasks, prompt_style: str = "compact"):
        from reflrl.engines.transformers_engine import Sample  # noqa: F401  (the protocol's sample type)
        from reflrl.envs.parsing import format_calls
        from reflrl.envs.prompts import build_messages
        from reflrl.rollout import render_prompt

        self.answers = {}
        for t in tasks:
            key = tuple(render_prompt(tok, build_messages(t, style=prompt_style)))
            self.answers[key] = tok(format_calls(list(t.gold[0]), "hermes"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate(self, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, stop_ids=None, seed=0,
                 stop_when=None):
        from reflrl.engines.transformers_engine import Sample

        out = []
        for i, p in enumerate(prompts):
            ids = self.answers.get(tuple(p))
            if ids is None:
                raise KeyError("GoldReplayEngine: a prompt that is not a task's first turn")
            out.extend(Sample(i, list(p), list(ids), [0.0] * len(ids), "stop") for _ in range(n))
        return out

    def update_weights(self, model) -> None:
        pass


def bench_concurrency(engine, tok, tasks, n, max_new_tokens, latency_ms, multi_turn, repeats, label="policy"):
    """The same rollouts twice: episodes stepped concurrently vs one tool call at a time, every tool
    call delayed ``latency_ms`` by the server (fault 'latency' at probability 1). The envs use the
    SYSTEM clock: in-process envs default to a virtual clock, on which latency costs no wall time."""
    import gymnasium as gym

    import reflrl.envs  # noqa: F401
    from reflrl import rollout as R

    env_id = "reflrl/ToolCallMultiTurn-v0" if multi_turn else "reflrl/ToolCall-v0"
    faults = f"latency=1.0:{latency_ms}ms"
    res = {}
    for mode in (True, False):
        envs = [gym.make(env_id, dataset=tasks, seed=k, faults=faults, prompt_style="compact",
                         concurrent_calls=mode, timeout=30.0, clock="system").unwrapped
                for k in range(len(tasks) * n)]
        cfg = R.RolloutSpec(max_new_tokens=max_new_tokens, temperature=1.0, concurrent=mode,
                              max_turns=3 if multi_turn else 1, max_total_tokens=1024)
        loop = asyncio.new_event_loop()
        timings_all = []

        def once():
            t = {}
            loop.run_until_complete(R.arollout(engine, tok, envs, tasks, n, cfg, seed=3, timings=t))
            timings_all.append(t)

        res[mode] = (median_time(once, repeats), timings_all[-1])
        for e in envs:
            loop.run_until_complete(e.aclose())
        loop.close()
    (tc, ttc), (ts, tts) = res[True], res[False]
    r = ts / tc
    kind = ("multi-turn (up to 3 turns)" if multi_turn else "single-turn") + f", {label}"
    print(f"(d) {kind} rollout of {len(tasks)}x{n} episodes, {latency_ms} ms per tool call: concurrent {tc:.2f}s "
          f"(generate {ttc['generate_s']:.2f}s), one-at-a-time {ts:.2f}s -> {r:.2f}x (target >= 2) "
          f"{'OK' if r >= 2 else 'MISSED'}")
    return {"concurrent_s": tc, "sequential_s": ts, "ratio": r, "generate_s": ttc["generate_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (auto: reflrl.precision)")
    p.add_argument("--trainable", default="top_layers:6")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch")
    p.add_argument("--n", type=int, default=8, help="rollouts per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--latency-ms", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="timings per figure of (a) and (c) (median)")
    p.add_argument("--d-repeats", type=int, default=1, help="rollouts per mode in (d)")
    p.add_argument("--run", help="a run folder whose pre-rollout filter skips to print too")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="SFT steps before measuring, so the policy emits tool calls (0 = base model)")
    p.add_argument("--only", default="abcd", help="which benchmarks to run (letters)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    from reflrl.envs.datasets import synthetic_splits

    torch.manual_seed(0)
    out: dict = {"machine": {"threads": torch.get_num_threads()}, "args": vars(args)}
    tasks = synthetic_splits(n_train=args.prompts, n_val=0, n_test=0, seed=5, kinds=("single",))["train"]
    t0 = time.perf_counter()
    model = tok = engine = trajs = None
    if set(args.only) & set("acd"):
        model, tok, engine = build(args.model, args.trainable, args.dtype)
        print(f"model {args.model} ({args.dtype}, trainable {args.trainable}) loaded in {time.perf_counter() - t0:.0f}s")
        if args.warmup_steps:
            from reflrl.envs.prompts import build_messages
            from reflrl.sft import build_examples, train_sft

            pool = synthetic_splits(n_train=128, n_val=0, n_test=0, seed=6)["train"]
            ex = build_examples(pool, tok, lambda t: build_messages(t, style="compact"))
            r = train_sft(model, tok, ex, steps=args.warmup_steps, batch_size=4, lr=5e-5, seed=0)
            print(f"warm-up: {r['steps']} SFT steps in {r['seconds']:.0f}s (loss {r['loss_first']:.2f} -> "
                  f"{r['loss_last']:.2f}) so that the policy emits tool calls")
    if set(args.only) & set("ac"):
        trajs = real_trajectories(engine, tok, tasks, args.n, args.max_new_tokens)
        L = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        print(f"batch: {len(tasks)} prompts x {args.n} rollouts, sequence length {min(L)}-{max(L)} tokens")
    if "a" in args.only:
        out["a_downsample"] = bench_downsample(model, tok, trajs, args.n, args.repeats)
    if "b" in args.only:
        out["b_prefilter"] = bench_prefilter(args.run)
    if "c" in args.only:
        out["c_overhead"] = bench_overhead(model, tok, trajs[: args.n], args.repeats)
    if "d" in args.only:
        out["d_concurrency_single"] = bench_concurrency(engine, tok, tasks, args.n, args.max_new_tokens,
                                                        args.latency_ms, False, args.d_repeats)
        out["d_concurrency_multi"] = bench_concurrency(engine, tok, tasks, args.n, args.max_new_tokens,
                                                       args.latency_ms, True, args.d_repeats)
        gold_tasks = synthetic_splits(n_train=args.prompts, n_val=0, n_test=0, seed=5)["train"]  # single + parallel
        out["d_concurrency_gold"] = bench_concurrency(GoldReplayEngine(tok, gold_tasks), tok, gold_tasks, args.n,
                                                      args.max_new_tokens, args.latency_ms, False, args.d_repeats,
                                                      label="gold-answer replay (environment side only, no model)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
