"""This CPU's floor for reflrl's work, and how far one RL step, one evaluation and one warm-up step are
from it -- measured in one run, every figure a ratio of two timings taken here and now.

    .venv/bin/python scripts/bench_floor.py [--checkpoint RUN/checkpoints/step_N] [--dtype auto|float32]
        [--threads 2] [--rl-steps 2] [--warmup-steps 3] [--peer] [--old-engine] [--set KEY=VALUE ...]
        [--json FILE]

1. The machine: matmul rate at the model's shapes (K=576, N=1536) for M = 1 .. 2048 rows, in each
   precision the model's layers take (the run's, and float32: a bfloat16 model trains its top layers in
   float32), the faster of the plain and the oneDNN-packed weight; memory bandwidth (a 256 MB copy);
   before and after the timed work (3.-5.), each time in a fresh process (the machine's figures, not
   those of this process's threads after the timed work).
2. Floors computed from those rates and each phase's own token counts, every layer's (and the output
   head's) FLOPs at the rate of its own precision:
   - prefill: the prompt tokens' FLOPs (2 x linear parameters + attention) at the large-M matmul rate;
   - decode: per decode step with b live rows over a context of c tokens, max((weight bytes + b x c x
     the KV cache's bytes per token) / bandwidth, FLOPs(b, c) / rate(b)): the step reads every weight
     and every live row's keys and values once;
   - update and warm-up: a bare forward+backward of the model on the SAME token batches (captured while
     the real step ran), plus one AdamW step over the trainable parameters.
3. The default recipe's pieces, timed: RL steps (from --checkpoint, e.g. the warm-up checkpoint of a
   run; without it the untrained policy writes longer, wrong answers), one greedy evaluation of the test
   split (48 tasks), warm-up (SFT) steps. Each is printed beside its floor, with where an RL step's time
   goes: prefill, decode, tools, critic, reflection (its prefill and decode), log-probs (the update's
   forward), backward, optimiser and the rest (Python, batching, accounting). With continuous batching
   (``rollout.continuous``, the default) the rollouts, the turns after faults and the reflection retries
   share one decode loop: their prefill and decode are counted together, under prefill and decode
   (``--set rollout.continuous=false``: fixed batches, the reflection retries counted apart).
4. Decode throughput at batch 32 (64 new tokens after 200-token prompts) against what the measured
   matmul rate and bandwidth allow.
5. --peer: TRL's GRPOTrainer (where installed) on the same batch (the step's prompts, n rollouts,
   same model and precision, no vLLM): its step time beside reflrl's.

The RL step's rollouts per minute are printed too; with --old-engine the same RL steps run again from the
same start on the engine as it was before its packed decode weights, native decode attention, shared-start
prefill and continuous batching (fixed batches), and the two rollouts-per-minute figures are compared. CPU-heavy (a few minutes on 2 cores): run it
alone; other busy processes make every multi-threaded operation wait.

A busy machine cannot pass: the matmul rates and the bandwidth are measured before AND after the timed
work, and the 1-minute load average is read before the start and after the timed work. Where a figure
moved by more than 20% between the two readings, or the load says another process was running
(:func:`floor_verdict` has the rule), no ratio is printed: the script says why (both readings, the
load) and exits with status 3. Otherwise every floor uses the faster of each figure's two readings.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reflrl.threads import configure_process  # noqa: E402

configure_process()  # the process settings of the reflrl command, before torch loads (reflrl.threads)

import torch  # noqa: E402

K_DIM, N_DIM = 576, 1536  # SmolLM2-135M's hidden and MLP widths: the decode matmuls' shape
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)


# ------------------------------------------------------------------------------------------ machine
def matmul_rates(dtype: torch.dtype, reps: int = 20, rounds: int = 3) -> dict[int, float]:
    """FLOP/s of [M, 576] @ [576, 1536] for each M in ROWS: the faster of ``F.linear`` and a weight packed
    for oneDNN (:mod:`reflrl.engines.packed`, where it can be packed), so the floor is what this machine's
    best kernel allows, whichever the run uses. Each M is timed in ``rounds`` rounds over all M (the
    median of ``reps`` calls in each) and its best round taken: a process's first round still compiles
    and warms oneDNN's kernels, and a reading taken once moves by a third from run to run at small M."""
    from reflrl.engines.packed import dense, pack

    best: dict[int, float] = {m: float("inf") for m in ROWS}
    w = torch.randn(N_DIM, K_DIM).to(dtype)
    weights = [w] + [p for p in (pack(w),) if p is not None]
    xs = {m: torch.randn(m, K_DIM).to(dtype) for m in ROWS}
    for _ in range(rounds):
        for m in ROWS:
            x = xs[m]
            for wk in weights:
                for _ in range(3):
                    dense(x, wk)
                n = max(3, reps if m <= 128 else 5)
                ts = []
                for _ in range(n):
                    t = time.perf_counter()
                    dense(x, wk)
                    ts.append(time.perf_counter() - t)
                best[m] = min(best[m], statistics.median(ts))
    return {m: 2 * m * K_DIM * N_DIM / t for m, t in best.items()}


def bandwidth(mb: int = 256) -> float:
    """Bytes/s of a large copy, read + write. Both buffers are written first: pages never written all map
    to the kernel's one zero page, which stays in the cache and reads at several times the memory's rate."""
    a = torch.ones(mb * 2**20, dtype=torch.uint8)
    b = torch.zeros_like(a)
    b.copy_(a)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t)
    return 2 * a.numel() / min(ts)


def rate_at(rates: dict[int, float], m: int) -> float:
    """Matmul FLOP/s for m rows, interpolated (log-linear) between the measured M."""
    ks = sorted(rates)
    if m <= ks[0]:
        return rates[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if m <= hi:
            f = (m - lo) / (hi - lo)
            return rates[lo] * (1 - f) + rates[hi] * f
    return rates[ks[-1]]


class Floors:
    """Floors of a model on this machine (see the module doc). ``rates``: matmul FLOP/s by rows M for each
    precision the model's decoder layers and output head take."""

    def __init__(self, model: torch.nn.Module, rates: dict[torch.dtype, dict[int, float]], bw: float):
        from reflrl.engines.continuous import kv_bytes_per_token

        cfg = model.config
        self.rates, self.bw = rates, bw
        head = model.get_output_embeddings().weight
        layers = model.get_decoder().layers
        self.groups: dict[torch.dtype, list[int]] = {}  # precision -> [linear parameters, layers]
        for layer in layers:
            g = self.groups.setdefault(layer.self_attn.q_proj.weight.dtype, [0, 0])
            g[0] += sum(p.numel() for p in layer.parameters())  # FLOPs per token / 2
            g[1] += 1
        self.head, self.head_dtype = head.numel(), head.dtype
        self.hidden = cfg.hidden_size
        self.weight_bytes = sum(p.numel() * p.element_size() for p in layers.parameters()) + \
            head.numel() * head.element_size()
        self.kv_per_token = kv_bytes_per_token(model)
        missing = {d for d in (*self.groups, self.head_dtype) if d not in rates}
        if missing:
            raise ValueError(f"Floors: no matmul rates measured for {sorted(map(str, missing))}")

    def prefill(self, tokens: int, mean_len: float) -> float:
        t = sum(tokens * (2 * lin + 4 * n * self.hidden * mean_len) / rate_at(self.rates[d], 2048)
                for d, (lin, n) in self.groups.items())
        return t + 2 * self.head / rate_at(self.rates[self.head_dtype], 1)

    def decode_step(self, rows: int, ctx: float) -> float:
        read = self.weight_bytes + rows * ctx * self.kv_per_token
        t = sum(rows * (2 * lin + 4 * n * self.hidden * ctx) / rate_at(self.rates[d], rows)
                for d, (lin, n) in self.groups.items())
        t += rows * 2 * self.head / rate_at(self.rates[self.head_dtype], rows)
        return max(read / self.bw, t)

    def decode(self, live_rows: list[int], ctx: float) -> float:
        return sum(self.decode_step(b, ctx) for b in live_rows)


# ------------------------------------------------------------------------------------ instrumentation
_POOL_KEYS = ("prefill_s", "decode_s", "prompt_tokens", "prompts", "new_tokens", "samples")


def _gen_record() -> dict[str, Any]:
    """What a phase's generation took and served: seconds, tokens, samples, rows per decode step, mean prompt
    length per call (``ctx``)."""
    return {"prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": 0, "prompts": 0, "new_tokens": 0, "samples": 0,
            "rows": [], "ctx": []}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


def _pool_counters(engine: Any) -> dict[str, Any] | None:
    """The counters of ``engine``'s shared decode loop (continuous batching) now, or None (no loop yet)."""
    pool = getattr(engine, "_pool", None)
    if pool is None:
        return None
    st = pool.stats
    return {"rows": len(st.decode_rows), **{k: getattr(st, k) for k in _POOL_KEYS}}


class Tap:
    """Wraps the trainer's parts to split a phase's time and keep what a floor is computed from."""

    def __init__(self, trainer: Any):
        self.t = trainer
        self.engines = list({id(e): e for e in (trainer.engine, trainer.eval_engine)}.values())
        self.reset()
        self._wrap_engine(trainer.engine)
        if trainer.eval_engine is not trainer.engine:
            self._wrap_engine(trainer.eval_engine)
        if trainer.critic is not None and hasattr(trainer.critic, "critique"):
            self._wrap_method(trainer.critic, "critique", "critic")
        for env in trainer.envs:
            u = env.unwrapped
            for name in ("areset", "astep"):
                if hasattr(u, name):
                    self._wrap_async(u, name, "tools")
        self._wrap_method(trainer, "recover", None, flag="in_recover")
        self._wrap_method(trainer.optimizer, "step", "optimizer")
        self._orig_backward = torch.autograd.backward
        tap = self

        def backward(*a, **k):
            t0 = time.perf_counter()
            try:
                return tap._orig_backward(*a, **k)
            finally:
                tap.add("backward", time.perf_counter() - t0)

        torch.autograd.backward = backward
        self.capture = False
        import reflrl.sft as SFT
        import reflrl.train.step as S

        orig_nll_backward = SFT.nll_backward

        def nll_backward(model, batch, *a, **k):  # the warm-up's batches (train_sft's loss and backward)
            if tap.capture:
                tap.batches.append((batch["input_ids"], batch["attention_mask"], batch["response_mask"]))
            return orig_nll_backward(model, batch, *a, **k)

        SFT.nll_backward = nll_backward

        orig_update = S.policy_update

        def policy_update(model, optimizer, batch, *a, **k):  # the RL update's rows, as full sequences
            tap.update_batches.append(batch)
            return orig_update(model, optimizer, batch, *a, **k)

        S.policy_update = policy_update

    def reset(self) -> None:
        self.pool_marks = {id(e): _pool_counters(e) for e in self.engines}
        self.times: dict[str, float] = {}
        self.gen: dict[str, dict[str, Any]] = {}
        self.batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.update_batches: list[Any] = []
        self.intervals: dict[str, list[tuple[float, float]]] = {}
        self.in_recover = False

    def pooled(self) -> dict[str, Any]:
        """What the engines' shared continuous-batching loops served since :meth:`reset` (rollouts, turns
        after faults and reflection retries together: they share decode steps), as a generation record."""
        g = _gen_record()
        for e in self.engines:
            now, then = _pool_counters(e), self.pool_marks.get(id(e))
            if now is None:
                continue
            base = then or {"rows": 0, **{k: 0 for k in _POOL_KEYS}}
            for k in _POOL_KEYS:
                g[k] += now[k] - base[k]
            rows = e._pool.stats.decode_rows[base["rows"]:]
            g["rows"] += list(rows)
            if now["prompts"] > base["prompts"]:
                g["ctx"].append((now["prompt_tokens"] - base["prompt_tokens"]) / (now["prompts"] - base["prompts"]))
        return g

    def generation(self, key: str) -> dict[str, Any]:
        """The generation record of ``key`` ("rollout" or "reflection") from fixed-batch calls, with the shared
        loops' (:meth:`pooled`) added to "rollout"."""
        g = self.gen.get(key)
        if key != "rollout":
            return g or {}
        p = self.pooled()
        if not p["samples"] and not p["decode_s"]:
            return g or {}
        return _merge(g, p) if g else p

    def add(self, key: str, dt: float) -> None:
        self.times[key] = self.times.get(key, 0.0) + dt

    def _wrap_engine(self, engine: Any) -> None:
        orig, tap = engine.generate, self

        def generate(*a, **k):
            out = orig(*a, **k)
            st = engine.last_stats
            g = tap.gen.setdefault("reflection" if tap.in_recover else "rollout", _gen_record())
            g["prefill_s"] += st.prefill_s
            g["decode_s"] += st.decode_s
            g["prompt_tokens"] += st.prompt_tokens
            g["prompts"] += st.prompts
            g["new_tokens"] += st.new_tokens
            g["samples"] += st.samples
            g["rows"] += list(st.decode_rows)
            g["ctx"].append(st.prompt_tokens / max(1, st.prompts))
            return out

        engine.generate = generate

    def _wrap_method(self, obj: Any, name: str, key: str | None, flag: str | None = None) -> None:
        orig, tap = getattr(obj, name), self

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            if flag:
                setattr(tap, flag, True)
            try:
                return orig(*a, **k)
            finally:
                if flag:
                    setattr(tap, flag, False)
                if key:
                    tap.add(key, time.perf_counter() - t0)

        setattr(obj, name, wrapped)

    def _wrap_async(self, obj: Any, name: str, key: str) -> None:
        """Env calls run concurrently: their time is the union of their intervals (wall time spent with at
        least one tool call in flight)."""
        orig, tap = getattr(obj, name), self

        async def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return await orig(*a, **k)
            finally:
                tap.intervals.setdefault(key, []).append((t0, time.perf_counter()))

        setattr(obj, name, wrapped)

    def union(self, key: str) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.intervals.get(key, [])):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


def bare_forward_backward(model: torch.nn.Module, batches: list, optimizer_params: list) -> float:
    """Seconds of a bare forward+backward of ``model`` on ``batches`` = [(ids, attention mask, loss mask)]
    -- the decoder over every token, the output head only where the loss is (the trained tokens), a mean
    log-likelihood -- and one AdamW step over the trainable parameters."""
    opt = torch.optim.AdamW(optimizer_params, lr=0.0)  # lr 0: the weights do not move
    head = model.get_output_embeddings()
    dec = model.get_decoder()
    model.train()
    t0 = time.perf_counter()
    for ids, am, rm in batches:
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        h = dec(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).last_hidden_state
        sel = rm[:, 1:].bool()
        logits = head(h[:, :-1][sel]).float()  # [trained tokens, V]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:][sel][:, None]).squeeze(-1)
        (-lp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def update_floor(model: torch.nn.Module, batches: list[Any]) -> float:
    """The floor of the RL update on ``batches`` (UpdateBatch, prompts stored once): a bare
    forward+backward's seconds per token, measured on the rows as full sequences, times the tokens the
    update must process (each distinct prompt once, every response)."""
    if not batches:
        return 0.0
    seqs, needed = [], 0
    for b in batches:
        needed += sum(len(p) for p in b.prompts) + int(b.resp_attn.sum())
        for r in range(len(b)):
            n = int(b.resp_attn[r].sum())
            p = list(b.prompts[int(b.owner[r])])
            seqs.append((p + b.resp_ids[r, :n].tolist(), len(p), b.response_mask[r, :n].tolist()))
    width = max(len(q) for q, _, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    am, rm = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (q, plen, resp) in enumerate(seqs):
        ids[i, : len(q)] = torch.tensor(q)
        am[i, : len(q)] = 1
        rm[i, plen: len(q)] = torch.tensor(resp, dtype=torch.long)
    mbs = [(ids[i: i + 8], am[i: i + 8], rm[i: i + 8]) for i in range(0, len(seqs), 8)]
    t = bare_forward_backward(model, mbs, [p for p in model.parameters() if p.requires_grad])
    return t / int(am.sum()) * needed


def floor_of_generation(fl: Floors, g: dict[str, Any]) -> tuple[float, float]:
    ctx = statistics.mean(g["ctx"]) if g["ctx"] else 0.0
    return fl.prefill(g["prompt_tokens"], ctx), fl.decode(g["rows"], ctx + 32)


# ------------------------------------------------------------------------------------------ the check
DRIFT_MAX = 0.20  # before/after floor figures further apart than this share of the larger: refused
LOAD_ALLOW_PER_CORE, LOAD_ALLOW_MIN = 0.25, 0.5  # runnable tasks beyond the benchmark's own, per core / at least


class FloorMeasure(NamedTuple):
    """The machine's floor figures at one moment: matmul FLOP/s by precision ("bfloat16", "float32") and
    rows M, memory bandwidth in bytes/s."""

    rates: dict[str, dict[int, float]]
    bw: float

    def best(self, other: "FloorMeasure") -> "FloorMeasure":
        """Each figure's faster reading of the two (the floor is what the machine can do)."""
        return FloorMeasure({d: {m: max(r, other.rates.get(d, {}).get(m, r)) for m, r in rs.items()}
                             for d, rs in self.rates.items()}, max(self.bw, other.bw))

    def by_dtype(self) -> dict[torch.dtype, dict[int, float]]:
        return {getattr(torch, d): rs for d, rs in self.rates.items()}


def measure_floor(dtype: torch.dtype) -> FloorMeasure:
    """The run's precision and float32 (what a bfloat16 model's trainable layers take)."""
    dts = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
    return FloorMeasure({str(d).removeprefix("torch."): matmul_rates(d) for d in dts}, bandwidth())


def measure_floor_fresh(dtype: torch.dtype, threads: int) -> FloorMeasure:
    """:func:`measure_floor` in a fresh Python process on ``threads`` threads: the machine's figures, not
    those of this process's state after the timed work (its executor threads' OpenMP teams, their waits,
    made PyTorch's few-row products 20-40% slower after it than before in the same process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--floor-only", str(dtype).removeprefix("torch."),
                          "--threads", str(threads)], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return FloorMeasure({k: {int(m): float(r) for m, r in v.items()} for k, v in d["rates"].items()}, float(d["bw"]))


def loadavg() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def load_allowance(ncpu: int) -> float:
    return max(LOAD_ALLOW_MIN, LOAD_ALLOW_PER_CORE * ncpu)


def floor_verdict(before: FloorMeasure, after: FloorMeasure, loadavg: tuple[float, float], ncpu: int,
                  threads: int) -> tuple[bool, str]:
    """Whether the run's ratios can be trusted: (ok, reason). Pure: the figures are passed in.

    ``before`` / ``after``: the floor figures measured before and after the timed work; ``loadavg``: the
    1-minute load average (before the benchmark started any work, after the timed work); ``ncpu``: the
    cores; ``threads``: the benchmark's torch threads.

    Refused when
    - a matmul rate (any M) or the bandwidth differs by more than :data:`DRIFT_MAX` (20%) of the larger
      of its two readings: something else took the cores during one of them, so the floor is not the
      machine's and neither are the timings between them;
    - the load before the start exceeds the allowance: more than max(0.5, 0.25 x cores) runnable tasks,
      with the benchmark still idle (a job that ended seconds ago still counts: the 1-minute average
      decays over a minute, which is the point -- its tail would slow the first measurement);
    - the load after exceeds ``threads`` (the benchmark's own busy threads, which the 1-minute average
      approaches during minutes of timed work) plus the same allowance: another process ran during
      the timed work's last minute or so.
    A disturbance that came and went in the middle of the timed work with both ends quiet is not seen
    by any of these; run the benchmark alone.
    """
    problems = []
    pairs = [(f"{d} matmul M={m}", rs[m] / 1e9, after.rates[d][m] / 1e9, "GFLOP/s")
             for d, rs in before.rates.items() if d in after.rates for m in rs if m in after.rates[d]]
    pairs.append(("memory bandwidth", before.bw / 1e9, after.bw / 1e9, "GB/s"))
    worst = []
    for name, a, b, unit in pairs:
        gap = abs(a - b) / max(a, b, 1e-12)
        if gap > DRIFT_MAX:
            worst.append((gap, f"{name} {a:.1f} before, {b:.1f} after {unit} ({100 * gap:.0f}% apart)"))
    if worst:
        worst.sort(reverse=True)
        problems.append(f"the floor moved by more than {100 * DRIFT_MAX:.0f}% between before and after the "
                        f"timed work: " + "; ".join(w for _, w in worst[:4]) +
                        (f"; and {len(worst) - 4} more" if len(worst) > 4 else ""))
    allow = load_allowance(ncpu)
    load_before, load_after = loadavg
    if load_before > allow:
        problems.append(f"load average {load_before:.2f} before the start on {ncpu} cores (allowed "
                        f"{allow:.2f} with the benchmark idle)")
    if load_after > threads + allow:
        problems.append(f"load average {load_after:.2f} after the timed work on {ncpu} cores (allowed "
                        f"{threads + allow:.2f}: the benchmark's threads, {threads}, + {allow:.2f})")
    if problems:
        return False, "the machine was busy: " + "; ".join(problems)
    return True, (f"floor steady (every figure within {100 * DRIFT_MAX:.0f}% before and after), load average "
                  f"{load_before:.2f} before and {load_after:.2f} after on {ncpu} cores")


def _gflops(rates: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    return {d: {m: r / 1e9 for m, r in rs.items()} for d, rs in rates.items()}


def floor_line(when: str, fm: FloorMeasure) -> str:
    return (f"floor {when}: matmul GFLOP/s (M x 576 x 1536) " +
            "; ".join(f"{d}: " + ", ".join(f"M={m} {r / 1e9:.0f}" for m, r in rs.items()) for d, rs in fm.rates.items())
            + f"; memory bandwidth {fm.bw / 1e9:.1f} GB/s (read + write)")


# ------------------------------------------------------------------------------------------- main
class Timed:
    """What the timed work measured; the floors and ratios are computed from it after the check.
    steps: per RL step, its wall time, where it went and the generation counts its floors need; eval:
    the same for the greedy evaluation; decode_tps: decode tokens/s at batch 32; warmup: a warm-up
    step's wall time and its bare forward+backward; peer: TRL's step time beside reflrl's (--peer);
    old_steps: the same RL steps' wall times and rollouts on the old engine (--old-engine)."""

    def __init__(self, model: torch.nn.Module, steps: list[dict[str, Any]] | None = None,
                 eval: dict[str, Any] | None = None, decode_tps: float = 0.0,
                 warmup: dict[str, float] | None = None, peer: dict[str, Any] | None = None,
                 old_steps: list[dict[str, Any]] | None = None):
        self.model, self.steps, self.eval = model, steps or [], eval or {}
        self.decode_tps, self.warmup, self.peer = decode_tps, warmup or {}, peer
        self.old_steps = old_steps or []  # --old-engine: the same RL steps on the old engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="start RL from this checkpoint (model.init_from)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rl-steps", type=int, default=2)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--faults", default="rate_limit=0.1")
    ap.add_argument("--peer", action="store_true", help="also time TRL's GRPOTrainer on the same batch")
    ap.add_argument("--old-engine", action="store_true",
                    help="also run the RL steps from the same start with the engine as it was before packed decode "
                         "weights, shared-start prefill and continuous batching: rollouts per minute, new against "
                         "old, in this run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--floor-only", default=None, choices=["float32", "bfloat16"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.floor_only:  # measure_floor_fresh's child: the floor figures as one JSON line
        torch.set_num_threads(args.threads)
        fm = measure_floor(getattr(torch, args.floor_only))
        print(json.dumps({"rates": fm.rates, "bw": fm.bw}))
        return 0
    load_before = loadavg()  # the benchmark has done nothing yet
    ncpu = os.cpu_count() or 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    from reflrl.precision import resolve_dtype

    choice = resolve_dtype(args.dtype)
    dtype = torch.bfloat16 if choice.dtype == "bfloat16" else torch.float32
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"CPU capability {cap}; {choice.log_line()}; torch threads {args.threads}; "
          f"load average before {load_before:.2f} on {ncpu} cores", flush=True)
    res: dict[str, Any] = {"cpu_capability": cap, "dtype": choice.dtype, "threads": args.threads}

    # 1. the machine, before the timed work
    before = measure_floor_fresh(dtype, args.threads)
    print(floor_line("before", before), flush=True)

    # 2-5. the timed work
    timed = run_timed(args)

    # 1 again: the machine after it, and whether the figures can be trusted
    after = measure_floor_fresh(dtype, args.threads)
    load_after = loadavg()
    print(floor_line("after", after), flush=True)
    ok, reason = floor_verdict(before, after, (load_before, load_after), ncpu, args.threads)
    res["floor_check"] = {"ok": ok, "reason": reason, "load_before": load_before, "load_after": load_after,
                          "cores": ncpu, **{f"{w}_{k}": v for w, fm in (("before", before), ("after", after))
                                            for k, v in (("matmul_gflops", _gflops(fm.rates)),
                                                         ("bandwidth_gbs", fm.bw / 1e9))}}
    if ok:
        print(f"floor check: {reason}", flush=True)
        best = before.best(after)
        res.update(matmul_gflops=_gflops(best.rates), bandwidth_gbs=best.bw / 1e9)
        report_ratios(Floors(timed.model, best.by_dtype(), best.bw), timed, res)
    else:
        print(f"NO RATIOS: {reason}. Run it again on a quiet machine.", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))
    return 0 if ok else 3


def run_timed(args: argparse.Namespace) -> Timed:
    """The default recipe's pieces, timed (the module doc's 3.-5.): wall times and where they go are
    printed as they come; the floors and ratios wait for the check."""
    from reflrl import config as C
    from reflrl.train.loop import Trainer

    over = [f"model.dtype={args.dtype}", f"env.faults={args.faults}", "train.out_dir=" + tempfile.mkdtemp(prefix="floor")]
    if args.checkpoint:
        over += [f"model.init_from={args.checkpoint}", "warmup.enabled=false"]
    cfg = C.load_config(None, over + list(args.set))
    tr = Trainer(cfg, Path(cfg.train.out_dir) / "run", progress=False, quiet=True)
    tap = Tap(tr)
    timed = Timed(model=tr.model)
    print(f"model: {sum(p.numel() for p in tr.model.parameters()) / 1e6:.1f}M parameters", flush=True)

    # 2. RL steps
    tr.train_step()  # warm (first-call allocations)
    tr.step += 1
    for _ in range(args.rl_steps):
        tap.reset()
        tap.capture = True
        t0 = time.perf_counter()
        m = tr.train_step()
        wall = time.perf_counter() - t0
        tap.capture = False
        tr.step += 1
        ro, rf = tap.generation("rollout"), tap.generation("reflection")
        fb_floor = update_floor(tr.model, tap.update_batches)
        upd = m.get("time_update_s", 0.0)
        parts = {"prefill": ro.get("prefill_s", 0.0), "decode": ro.get("decode_s", 0.0),
                 "tools": tap.union("tools"), "critic": tap.times.get("critic", 0.0),
                 "reflection": rf.get("prefill_s", 0.0) + rf.get("decode_s", 0.0),
                 "backward": tap.times.get("backward", 0.0), "optimizer": tap.times.get("optimizer", 0.0)}
        parts["log-probs"] = max(0.0, upd - parts["backward"] - parts["optimizer"])
        parts["other"] = wall - sum(parts.values())
        n_roll = ro.get("samples", 0) + rf.get("samples", 0)  # rollouts and reflection retries sampled
        s = {"wall_s": wall, "parts": parts, "rollout": ro, "reflection": rf, "forward+backward_floor_s": fb_floor,
             "new_tokens": ro.get("new_tokens", 0) + rf.get("new_tokens", 0),
             "rollouts": n_roll, "rollouts_per_min": 60 * n_roll / wall}
        timed.steps.append(s)
        print(f"RL step: {wall:.2f}s; {n_roll} rollouts ({s['rollouts_per_min']:.0f}/min), "
              f"{s['new_tokens']} new tokens", flush=True)
        print("  where it goes: " + ", ".join(f"{k} {v:.2f}s" for k, v in parts.items()), flush=True)

    if getattr(args, "old_engine", False):
        timed.old_steps = old_engine_steps(cfg, args.rl_steps)

    # 3. greedy evaluation of the test split
    tap.reset()
    t0 = time.perf_counter()
    ev = tr.evaluate("test")
    wall = time.perf_counter() - t0
    g = tap.generation("rollout")
    timed.eval = {"tasks": len(tr.splits["test"]), "wall_s": wall, "gen": g, "tools_s": tap.union("tools"),
                  "accuracy": ev.get("accuracy")}
    print(f"greedy evaluation of {len(tr.splits['test'])} tasks: {wall:.1f}s (prefill {g.get('prefill_s', 0):.1f}s, "
          f"decode {g.get('decode_s', 0):.1f}s, tools {timed.eval['tools_s']:.1f}s; {g.get('new_tokens')} new tokens)",
          flush=True)

    # 4. decode throughput at batch 32
    from reflrl.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(tr.model, tr.tokenizer, packed=tr.engine.packed,  # the run's decode path
                             continuous=tr.engine.continuous, attention=tr.engine.attention,
                             matmul=tr.engine.matmul)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (200,), generator=gen).tolist() for _ in range(32)]
    eng.generate(prompts[:2], n=1, max_new_tokens=4, stop_ids=[], seed=0)
    eng.generate(prompts, n=1, max_new_tokens=64, stop_ids=[], seed=0)
    st = eng.last_stats
    timed.decode_tps = st.new_tokens / st.decode_s
    print(f"decode at batch 32: {timed.decode_tps:.0f} tokens/s", flush=True)

    # 5. warm-up (SFT) steps
    from reflrl.sft import build_examples, train_sft
    from reflrl.train.setup import answer_format

    ex = build_examples(tr.train_tasks[:64], tr.tokenizer, tr.messages, answer_format(cfg))
    tap.reset()
    tap.capture = True
    out = train_sft(tr.model, tr.tokenizer, ex, steps=args.warmup_steps, batch_size=cfg.warmup.batch_size,
                    lr=0.0, seed=0)
    tap.capture = False
    per = out["seconds"] / max(1, out["steps"])
    fb = bare_forward_backward(tr.model, tap.batches, [p for p in tr.model.parameters() if p.requires_grad])
    timed.warmup = {"wall_s": per, "floor_s": fb / max(1, out["steps"])}
    print(f"warm-up step: {per:.2f}s; bare forward+backward+AdamW on the same tokens "
          f"{timed.warmup['floor_s']:.2f}s", flush=True)

    if args.peer:
        timed.peer = peer(tr, cfg, timed.steps)
    tr.close()
    return timed


def old_engine_steps(cfg: Any, steps: int) -> list[dict[str, Any]]:
    """The RL steps again, from the same start (a fresh trainer on the same config and seed), with the
    engine as it was before its speed-ups: plain ``F.linear`` decode weights
    (``rollout.packed_weights=false``, ``rollout.decode_matmul=torch``), SDPA for the decode attention
    (``rollout.decode_attention=sdpa``), every
    prompt prefilled whole (no shared start) and fixed batches (``rollout.continuous=false``). Wall time and
    rollouts (with reflection retries) per step; the first step warms up, as in the new engine's run."""
    from dataclasses import replace

    import reflrl.engines.transformers_engine as TE
    from reflrl.train.loop import Trainer

    old_cfg = replace(cfg, rollout=replace(cfg.rollout, packed_weights="false", decode_attention="sdpa",
                                           decode_matmul="torch", continuous=False),
                      train=replace(cfg.train, out_dir=tempfile.mkdtemp(prefix="floor-old")))
    keep = TE.SHARED_PREFIX_MIN
    TE.SHARED_PREFIX_MIN = 10**9
    out = []
    try:
        tr = Trainer(old_cfg, Path(old_cfg.train.out_dir) / "run", progress=False, quiet=True)
        counts: dict[str, int] = {"n": 0}
        for eng in {id(tr.engine): tr.engine, id(tr.eval_engine): tr.eval_engine}.values():
            orig = eng.generate

            def generate(*a, _orig=orig, **k):
                got = _orig(*a, **k)
                counts["n"] += len(got)
                return got

            eng.generate = generate
        tr.train_step()
        tr.step += 1
        for _ in range(steps):
            counts["n"] = 0
            t0 = time.perf_counter()
            tr.train_step()
            wall = time.perf_counter() - t0
            tr.step += 1
            out.append({"wall_s": wall, "samples": counts["n"], "samples_per_min": 60 * counts["n"] / wall})
            print(f"old engine, RL step: {wall:.2f}s; {counts['n']} samples ({out[-1]['samples_per_min']:.0f}/min)",
                  flush=True)
        tr.close()
    finally:
        TE.SHARED_PREFIX_MIN = keep
    return out


def report_ratios(fl: Floors, timed: Timed, res: dict[str, Any]) -> None:
    """Print each timed piece beside its floor (only once the floor check passed) and fill ``res``."""
    print(f"{fl.weight_bytes / 2**20:.0f} MiB of weights and {fl.kv_per_token / 2**10:.1f} KiB of keys and values per "
          f"row and context token read per decode step; decode-step floor "
          f"{1000 * fl.decode_step(1, 300):.1f} ms (1 row) .. {1000 * fl.decode_step(32, 300):.1f} ms (32 rows)",
          flush=True)
    steps = []
    for s in timed.steps:
        ro, rf = s["rollout"], s["reflection"]
        pre_f, dec_f = floor_of_generation(fl, ro) if ro else (0.0, 0.0)
        rpre_f, rdec_f = floor_of_generation(fl, rf) if rf else (0.0, 0.0)
        fb_floor = s["forward+backward_floor_s"]
        floor = pre_f + dec_f + rpre_f + rdec_f + fb_floor
        row = {"wall_s": s["wall_s"], "floor_s": floor, "ratio": s["wall_s"] / floor if floor else None,
               "parts": s["parts"], "floor_parts": {"prefill": pre_f, "decode": dec_f,
                                                    "reflection": rpre_f + rdec_f, "forward+backward": fb_floor},
               "new_tokens": s["new_tokens"], "rollouts": s["rollouts"], "rollouts_per_min": s["rollouts_per_min"]}
        steps.append(row)
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
        print(f"RL step: {s['wall_s']:.2f}s, floor {floor:.2f}s -> {ratio}", flush=True)
        print("  floor parts:   " + ", ".join(f"{k} {v:.2f}s" for k, v in row["floor_parts"].items()), flush=True)
    res["rl_steps"] = steps
    if timed.old_steps:
        new_w, old_w = sum(s["wall_s"] for s in timed.steps), sum(s["wall_s"] for s in timed.old_steps)
        new_r = 60 * sum(s["rollouts"] for s in timed.steps) / new_w
        old_r = 60 * sum(s["samples"] for s in timed.old_steps) / old_w
        res["old_engine"] = {"steps": timed.old_steps, "wall_s": old_w, "new_wall_s": new_w,
                             "rollouts_per_min": old_r, "new_rollouts_per_min": new_r, "gain": new_r / old_r}
        print(f"rollouts and retries per minute: {new_r:.1f}, the old engine {old_r:.1f} on the same RL steps "
              f"({new_w:.1f}s against {old_w:.1f}s) -> {new_r / old_r:.2f}x", flush=True)

    e = timed.eval
    if e:
        g = e["gen"]
        pre_f, dec_f = floor_of_generation(fl, g) if g else (0.0, 0.0)
        floor = pre_f + dec_f
        res["eval"] = {"tasks": e["tasks"], "wall_s": e["wall_s"], "floor_s": floor,
                       "ratio": e["wall_s"] / floor if floor else None,
                       "floor_parts": {"prefill": pre_f, "decode": dec_f}, "prompt_tokens": g.get("prompt_tokens"),
                       "decode_steps": len(g.get("rows", ())), "prefill_s": g.get("prefill_s"),
                       "decode_s": g.get("decode_s"), "tools_s": e["tools_s"], "new_tokens": g.get("new_tokens"),
                       "accuracy": e["accuracy"]}
        ratio = f"{e['wall_s'] / floor:.2f}x" if floor else "-"
        print(f"greedy evaluation of {e['tasks']} tasks: {e['wall_s']:.1f}s, floor {floor:.2f}s -> {ratio}", flush=True)
        print(f"  floor parts:   prefill {pre_f:.2f}s ({g.get('prompt_tokens')} prompt tokens), decode {dec_f:.2f}s "
              f"({len(g.get('rows', ()))} steps)", flush=True)

    if timed.decode_tps:
        allowed = 32 / fl.decode_step(32, 232)
        tps = timed.decode_tps
        res["decode_b32"] = {"tokens_per_s": tps, "floor_tokens_per_s": allowed, "share_of_floor": tps / allowed}
        print(f"decode at batch 32: {tps:.0f} tokens/s; the matmul rate and bandwidth allow {allowed:.0f} "
              f"({100 * tps / allowed:.0f}%)", flush=True)

    w = timed.warmup
    if w:
        res["warmup_step"] = {"wall_s": w["wall_s"], "floor_s": w["floor_s"], "ratio": w["wall_s"] / w["floor_s"]}
        print(f"warm-up step: {w['wall_s']:.2f}s, bare forward+backward+AdamW on the same tokens {w['floor_s']:.2f}s "
              f"-> {w['wall_s'] / w['floor_s']:.2f}x", flush=True)

    p = timed.peer
    if p:
        p = dict(p, speedup=p["trl_step_s"] / p["reflrl_step_s"])
        res["peer"] = p
        print(f"peer: TRL {p['trl_version']} GRPOTrainer {p['trl_step_s']:.1f}s per step, reflrl "
              f"{p['reflrl_step_s']:.1f}s -> reflrl {p['speedup']:.1f}x faster", flush=True)


def peer(tr: Any, cfg: Any, steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """TRL's GRPOTrainer on the same batch: cfg.rollout.batch_prompts prompts x n completions, the same
    model (a copy of the policy at this point) and precision, the same per-task token caps' maximum."""
    try:
        import trl  # noqa: F401
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"peer: TRL not installed ({e}); skipped")
        return None
    import copy

    from reflrl.rollout import RolloutSpec, answer_token_cap

    B, n = cfg.rollout.batch_prompts, cfg.rollout.n
    tasks = tr.train_tasks[:B]
    spec = tr.rollout_cfg
    cap = max(answer_token_cap(t, tr.tokenizer, spec) for t in tasks)
    rows = [{"prompt": tr.messages(t)} for t in tasks]
    model = copy.deepcopy(tr.model)
    out = tempfile.mkdtemp(prefix="trlpeer")
    bf16 = next(model.parameters()).dtype == torch.bfloat16 or cfg.model.dtype == "bfloat16"
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=B * n, num_generations=n, max_completion_length=cap,
                      temperature=cfg.rollout.temperature, learning_rate=cfg.algo.lr, beta=0.0, max_steps=3,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                      gradient_checkpointing=False, seed=0, dataloader_num_workers=0)
    times: list[float] = []

    def reward(completions, **_kw):
        return [float(len(str(c))) % 2 for c in completions]  # any reward: the step's cost is what is timed

    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows * 3), reward_funcs=reward,
                          processing_class=tr.tokenizer)
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    trainer.train()
    mine = statistics.median(s["wall_s"] for s in steps)
    theirs = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(f"peer: TRL {trl.__version__} GRPOTrainer, {B} prompts x {n}, {cap} new tokens at most, "
          f"{'bfloat16 weights' if bf16 else 'float32'}: {theirs:.1f}s per step (median of {len(times) - 1}); "
          f"reflrl {mine:.1f}s", flush=True)
    return {"trl_version": trl.__version__, "trl_step_s": theirs, "reflrl_step_s": mine}


if __name__ == "__main__":
    raise SystemExit(main())
