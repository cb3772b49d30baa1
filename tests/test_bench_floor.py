"""scripts/bench_floor.py refuses to print ratios measured on a busy machine: the floor is measured before
and after the timed work, and the load average is read; the measurements are injected here, so the test
does not depend on this machine's load."""
from __future__ import annotations

import json

import pytest
import torch

from script_loader import load_script

GF = 1e9
QUIET = {1: 2 * GF, 8: 15 * GF, 32: 60 * GF, 2048: 250 * GF}


def _fm(bf, rates=QUIET, bw=20e9):
    return bf.FloorMeasure({"float32": dict(rates)}, bw)


def test_agreeing_figures_and_a_quiet_load_pass():
    bf = load_script("bench_floor")
    after = _fm(bf, {m: r * 0.9 for m, r in QUIET.items()}, 18e9)  # 10% apart: within the rule
    ok, reason = bf.floor_verdict(_fm(bf), after, (0.1, 2.3), ncpu=2, threads=2)
    assert ok and "0.10 before and 2.30 after" in reason


def test_a_floor_that_moved_is_refused_naming_both_readings():
    bf = load_script("bench_floor")
    # what a run started while another benchmark was finishing measured: bfloat16 matmuls at 0-7 GFLOP/s
    busy = _fm(bf, {1: 0.1 * GF, 8: 3 * GF, 32: 7 * GF, 2048: 7 * GF})
    ok, reason = bf.floor_verdict(busy, _fm(bf), (0.2, 2.0), ncpu=2, threads=2)
    assert not ok
    assert "float32 matmul M=2048 7.0 before, 250.0 after GFLOP/s (97% apart)" in reason
    ok, reason = bf.floor_verdict(_fm(bf), _fm(bf, bw=12e9), (0.2, 2.0), ncpu=2, threads=2)
    assert not ok and "memory bandwidth 20.0 before, 12.0 after GB/s (40% apart)" in reason


@pytest.mark.parametrize("load, ncpu, threads, where", [
    ((1.1, 2.0), 2, 2, "1.10 before the start"),       # another job's threads still in the 1-minute average
    ((0.0, 3.2), 2, 2, "3.20 after the timed work"),   # beyond the benchmark's 2 threads + 0.5
    ((3.0, 8.0), 8, 4, "3.00 before the start"),      # 8 cores: 2.0 allowed before
])
def test_a_high_load_average_is_refused(load, ncpu, threads, where):
    bf = load_script("bench_floor")
    ok, reason = bf.floor_verdict(_fm(bf), _fm(bf), load, ncpu=ncpu, threads=threads)
    assert not ok and where in reason and "busy" in reason


def test_the_decode_floor_reads_the_kv_cache_and_prices_each_layer_at_its_precision():
    """A bfloat16 model whose top layer trains in float32: the floor needs both precisions' rates, a step
    over long contexts is bound by the weights AND the keys/values it reads, and a slower float32 rate
    raises the floor by the float32 layers' (and head's) FLOPs alone."""
    import torch
    from reflrl.engines.continuous import kv_bytes_per_token
    from reflrl.models import load_model

    bf = load_script("bench_floor")
    model, _ = load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1", seed=0)
    flat = {1: 1e9, 2048: 1e9}
    with pytest.raises(ValueError, match="float32"):
        bf.Floors(model, {torch.bfloat16: flat}, 1e9)
    fast = {1: 1e30, 2048: 1e30}  # matmuls free: the bandwidth decides
    fl = bf.Floors(model, {torch.bfloat16: fast, torch.float32: fast}, 1e9)
    kv = kv_bytes_per_token(model)
    assert fl.kv_per_token == kv > 0
    assert fl.decode_step(8, 100) == pytest.approx((fl.weight_bytes + 8 * 100 * kv) / 1e9)
    assert fl.decode_step(8, 1000) > fl.decode_step(8, 100) > fl.decode_step(1, 100)
    # bandwidth free: the FLOPs decide; float32 twice as slow adds the float32 share once more
    both = bf.Floors(model, {torch.bfloat16: flat, torch.float32: flat}, 1e30)
    slow32 = bf.Floors(model, {torch.bfloat16: flat, torch.float32: {m: r / 2 for m, r in flat.items()}}, 1e30)
    layers = model.get_decoder().layers
    top = layers[-1]
    assert top.self_attn.q_proj.weight.dtype == torch.float32 and layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    h = model.config.hidden_size
    f32_flops = 4 * (2 * sum(p.numel() for p in top.parameters()) + 4 * h * 50)  # 4 rows, context 50
    f32_flops += 4 * 2 * model.get_output_embeddings().weight.numel() * (
        model.get_output_embeddings().weight.dtype == torch.float32)
    assert slow32.decode_step(4, 50) - both.decode_step(4, 50) == pytest.approx(f32_flops / 1e9)


def _fake_run(bf, monkeypatch, floors, loads):
    """main() with the machine's measurements and the timed work replaced: the tiny model, one RL step's
    and one evaluation's token counts and seconds."""
    from reflrl.models import load_model

    model, _ = load_model("tiny-random", dtype="float32", seed=0)
    gen = {"prefill_s": 0.2, "decode_s": 1.0, "prompt_tokens": 400, "prompts": 4, "new_tokens": 64, "samples": 8,
           "rows": [8] * 8, "ctx": [100.0]}
    step = {"wall_s": 2.0, "parts": {"decode": 1.0}, "rollout": gen, "reflection": {},
            "forward+backward_floor_s": 0.1, "new_tokens": 64, "rollouts": 8, "rollouts_per_min": 240.0}
    timed = bf.Timed(model=model, steps=[step], eval={"tasks": 4, "wall_s": 1.5, "gen": gen, "tools_s": 0.1,
                                                      "accuracy": 0.5},
                     decode_tps=100.0, warmup={"wall_s": 0.5, "floor_s": 0.25},
                     old_steps=[{"wall_s": 3.0, "samples": 6, "samples_per_min": 120.0}])
    monkeypatch.setattr(bf, "measure_floor_fresh", lambda dtype, threads: floors.pop(0))
    monkeypatch.setattr(bf, "loadavg", lambda: loads.pop(0))
    monkeypatch.setattr(bf, "run_timed", lambda args: timed)
    monkeypatch.setattr(bf.os, "cpu_count", lambda: 2)


def test_main_on_a_disturbed_machine_prints_no_ratio_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    bf = load_script("bench_floor")
    busy = _fm(bf, {m: r / 40 for m, r in QUIET.items()})
    _fake_run(bf, monkeypatch, [busy, _fm(bf)], [2.4, 2.1])
    code = bf.main(["--dtype", "float32", "--threads", "2", "--json", str(tmp_path / "f.json")])
    out = capsys.readouterr().out
    assert code != 0
    assert "NO RATIOS: the machine was busy" in out and "load average 2.40 before the start" in out
    assert "(98% apart)" in out  # the two readings, side by side
    assert "->" not in out and "floor 0" not in out
    res = json.loads((tmp_path / "f.json").read_text())
    assert res["floor_check"]["ok"] is False and "rl_steps" not in res and "eval" not in res


def test_main_on_a_quiet_machine_prints_the_ratios(tmp_path, monkeypatch, capsys):
    bf = load_script("bench_floor")
    _fake_run(bf, monkeypatch, [_fm(bf), _fm(bf, {m: r * 0.95 for m, r in QUIET.items()})], [0.05, 2.0])
    code = bf.main(["--dtype", "float32", "--threads", "2", "--json", str(tmp_path / "f.json")])
    out = capsys.readouterr().out
    assert code == 0 and "floor check: floor steady" in out and "NO RATIOS" not in out
    assert "RL step: 2.00s, floor" in out and "greedy evaluation of 4 tasks: 1.5s, floor" in out
    assert "warm-up step: 0.50s, bare forward+backward+AdamW on the same tokens 0.25s -> 2.00x" in out
    # --old-engine: 8 samples in 2 s against 6 in 3 s
    assert "rollouts and retries per minute: 240.0, the old engine 120.0 on the same RL steps (2.0s against 3.0s) -> 2.00x" in out
    res = json.loads((tmp_path / "f.json").read_text())
    assert res["floor_check"]["ok"] is True and res["rl_steps"][0]["ratio"] > 0
    assert res["matmul_gflops"]["float32"]["2048"] == pytest.approx(250.0)  # the faster of the two readings


def test_the_tap_captures_the_warm_ups_batches_as_train_sft_runs_them(monkeypatch):
    """The warm-up floor is a bare forward+backward on the batches train_sft really trained on: the tap
    must see them (it once hooked a function train_sft no longer called, and the floor read 0.15 s)."""
    from types import SimpleNamespace

    import reflrl.sft as SFT
    import reflrl.train.step as S
    import torch
    from reflrl.models import load_model

    bf = load_script("bench_floor")
    monkeypatch.setattr(SFT, "nll_backward", SFT.nll_backward)  # the tap's patches are undone after the test
    monkeypatch.setattr(S, "policy_update", S.policy_update)
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    nothing = SimpleNamespace(generate=lambda *a, **k: [], agenerate=None)
    trainer = SimpleNamespace(engine=nothing, eval_engine=nothing, critic=None, envs=[], recover=lambda: None,
                              optimizer=SimpleNamespace(step=lambda: None))
    tap = bf.Tap(trainer)
    tap.capture = True
    ex = [SFT.SFTExample(tok.encode(f"weather in city {i}?"), tok.encode(" ok") + [tok.eos_token_id], f"t{i}")
          for i in range(4)]
    SFT.train_sft(model, tok, ex, steps=2, batch_size=2, lr=0.0, seed=0)
    assert len(tap.batches) == 2 and all(ids.shape[0] == 2 for ids, _, _ in tap.batches)
    assert bf.bare_forward_backward(model, tap.batches, [p for p in model.parameters() if p.requires_grad]) > 0


def test_the_tap_counts_what_a_shared_continuous_batching_loop_served(monkeypatch):
    """With continuous batching the rollouts and reflection retries decode in the engine's shared loop
    (``agenerate``), not through ``generate``: the tap must count their samples, tokens, rows and seconds
    since its last reset (it once read 0 rollouts and no prefill or decode for a whole RL step)."""
    import asyncio
    from types import SimpleNamespace

    import reflrl.sft as SFT
    import reflrl.train.step as S
    import torch
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.models import load_model

    bf = load_script("bench_floor")
    monkeypatch.setattr(SFT, "nll_backward", SFT.nll_backward)  # the tap's patches are undone after the test
    monkeypatch.setattr(S, "policy_update", S.policy_update)
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)
    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    eng = TransformersEngine(model, tok, continuous=True, max_batch_size=4)
    trainer = SimpleNamespace(engine=eng, eval_engine=eng, critic=None, envs=[], recover=lambda: None,
                              optimizer=SimpleNamespace(step=lambda: None))
    tap = bf.Tap(trainer)
    prompts = [tok.encode("hello there"), tok.encode("another prompt of middling length")]

    async def serve(seed):
        return await asyncio.gather(*(eng.agenerate([p], n=3, max_new_tokens=6, temperature=1.0, seed=seed + i)
                                      for i, p in enumerate(prompts)))

    asyncio.run(serve(0))  # before the reset: not counted
    tap.reset()
    got = asyncio.run(serve(10))
    g = tap.generation("rollout")
    samples = [s for out in got for s in out]
    assert g["samples"] == len(samples) == 6 and g["prompts"] == 2
    assert g["new_tokens"] == sum(len(s.token_ids) for s in samples)
    assert g["prompt_tokens"] == sum(len(p) for p in prompts)
    assert g["rows"] and max(g["rows"]) <= 4 and g["prefill_s"] > 0 and g["decode_s"] > 0
    assert g["ctx"] == [sum(len(p) for p in prompts) / 2]
    assert tap.generation("reflection") == {}
    tap.reset()
    assert tap.generation("rollout") == {}  # nothing served since


def test_the_floor_is_measured_in_a_fresh_process():
    """measure_floor_fresh runs the script again with --floor-only: a child that prints the figures as one
    JSON line, read back as the FloorMeasure this process would have measured."""
    bf = load_script("bench_floor")
    fm = bf.measure_floor_fresh(torch.float32, 1)
    assert set(fm.rates) == {"float32"} and set(fm.rates["float32"]) == {1, 2, 4, 8, 16, 32, 64, 128, 512, 2048}
    assert all(r > 0 for r in fm.rates["float32"].values()) and fm.bw > 0
