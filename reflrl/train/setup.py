"""What a run is built from: the model, its engines, the environments and the critic (:class:`Components`),
assembled from a config by :func:`build_components`. Tests and tools swap a part by passing it in
(``engine=``: a factory ``(model, tokenizer) -> RolloutEngine``, e.g. a scripted engine)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from reflrl import config as C
from reflrl.device import resolve_device, resolve_precision
from reflrl.engines.native_attention import AttentionChoice, resolve as resolve_attention
from reflrl.engines.native_matmul import MatmulChoice, resolve as resolve_matmul
from reflrl.engines.packed import PackedChoice, resolve as resolve_packed
from reflrl.precision import DtypeChoice
from reflrl.threads import fix_threads
from reflrl.recovery import Variant, build_critic, think_of, uses_endpoint, variant_of
from reflrl.rollout import RolloutSpec
from reflrl.diskspace import check_disk_space, human_bytes
from reflrl.runlog import checkpoint_bytes, list_checkpoints, load_checkpoint

EngineFactory = Callable[[torch.nn.Module, Any], Any]
EnvFactory = Callable[..., tuple[list[Any], Any]]  # (cfg, tasks, count) -> (envs, server or None), as make_envs


def answer_format(cfg: C.Config) -> str:
    """The tool-call format prompts ask for and answers are written in ('auto' parses any: ask hermes)."""
    return "hermes" if cfg.env.parser == "auto" else cfg.env.parser


def messages_fn(cfg: C.Config) -> Callable[[Any], list[dict]]:
    """``task -> the chat messages that start an episode`` (the envs' own rendering)."""
    from reflrl.envs.prompts import build_messages

    style, fmt, think = cfg.data.prompt_style, answer_format(cfg), think_of(cfg)
    return lambda task: build_messages(task, style=style, fmt=fmt, think=think)


def check_checkpoint_space(cfg: C.Config, run_dir: str | Path, model: torch.nn.Module, *, resume: bool = False,
                           disk_usage: Callable[[Path], Any] | None = None) -> int:
    """Raise :class:`~reflrl.errors.DiskSpaceError` unless the run folder's disk can hold the checkpoints
    the run keeps at once: ``train.keep_checkpoints`` plus the one being written, or fewer if the run
    writes fewer (after the warm-up, every ``train.save_every`` RL steps, at the end), less those a
    resumed run already has. Returns the free bytes."""
    tr = cfg.train
    saves = 2 + (tr.steps // tr.save_every if tr.save_every else 0)
    held = min(tr.keep_checkpoints + 1, saves)
    have = len(list_checkpoints(run_dir)) if resume and Path(run_dir).is_dir() else 0
    per = checkpoint_bytes(model)
    return check_disk_space(
        run_dir, max(1, held - have) * per,
        f"this run's checkpoints (up to {held} at once, about {human_bytes(per)} each: "
        f"train.keep_checkpoints={tr.keep_checkpoints} kept while the next is written)",
        hint="free some space, choose another train.out_dir, or lower train.keep_checkpoints",
        disk_usage=disk_usage)


@dataclass
class Components:
    """The parts of a run. ``engine`` samples rollouts and reflection retries from the trained model;
    ``eval_engine`` decodes the held-out evaluations (reusing the frozen trunk's prompt states);
    ``remote_engine``: a vLLM / OpenAI-compatible engine that samples the RL rollouts instead (None)."""

    model: torch.nn.Module
    tokenizer: Any
    precision: DtypeChoice
    engine: Any
    eval_engine: Any
    remote_engine: Any
    variant: Variant
    critic: Any
    envs: list[Any]
    tool_server: Any
    rollout: RolloutSpec
    load_s: float
    decode_weights: PackedChoice | None = None  # rollout.packed_weights as resolved (None: an engine was given)
    decode_attention: AttentionChoice | None = None  # rollout.decode_attention as resolved (None: as above)
    decode_matmul: MatmulChoice | None = None  # rollout.decode_matmul as resolved (None: as above)


def load_policy(cfg: C.Config, say: Callable[[str], None]) -> tuple[torch.nn.Module, Any, DtypeChoice, float]:
    """(model, tokenizer, precision, seconds): the policy in the precision ``model.dtype`` resolves to here."""
    from transformers.utils import logging as hf_logging

    from reflrl.models import load_model

    hf_logging.disable_progress_bar()  # our own bars only
    t0 = time.perf_counter()
    m = cfg.model
    device = resolve_device(cfg.train.device)  # ConfigError: train.device=cuda where torch sees no GPU
    # 'auto': on the CPU bfloat16 only where it computes it natively; on CUDA bfloat16 where supported
    precision = resolve_precision(m.dtype, device)
    say(precision.log_line() + (f" on {device}" if device.type != "cpu" else ""))
    if precision.warning:
        print(f"[reflrl] warning: {precision.warning}", file=sys.stderr, flush=True)
    # the torch dtype, not its name: load_model would resolve and announce 'bfloat16' a second time
    model, tok = load_model(m.name, dtype=getattr(torch, precision.dtype), trainable=m.trainable, lora_r=m.lora_r,
                            lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, seed=cfg.train.seed,
                            trainable_dtype=m.trainable_dtype)
    model.to(device)  # a no-op on the CPU; the trainable/frozen dtypes are kept
    if m.init_from:  # e.g. RL variants that share one warm-up (scripts/paper_table.py --warm-start)
        load_checkpoint(Path(m.init_from).expanduser(), model=model, optimizer=None, restore_rng=False)
    return model, tok, precision, time.perf_counter() - t0


def remote_engine(cfg: C.Config, tokenizer: Any) -> Any:
    """The engine that samples RL rollouts when it is not the trained model itself (``rollout.engine``).

    'transformers': None (rollouts come from the trained model: always on-policy). 'vllm': the vLLM
    offline engine on one GPU; the trainer replaces its weights after every update, so rollouts stay
    on-policy. 'openai': an OpenAI-compatible server that samples from ITS OWN weights, never synced:
    off-policy after the first update and not corrected for (config validation refuses it unless
    ``rollout.engine_off_policy=true``); held-out evaluation still scores the local, trained model."""
    r = cfg.rollout
    if r.engine == "transformers":
        return None
    from reflrl.engines import get_engine

    if r.engine == "vllm":
        from reflrl.models import EMBEDDED_NAME, _convert_embedded

        path = str(_convert_embedded()) if cfg.model.name == EMBEDDED_NAME else cfg.model.name
        return get_engine("vllm", model_path=path, dtype=cfg.model.dtype, seed=cfg.train.seed)
    print(f"[reflrl] warning: rollouts come from {r.engine_base_url} (rollout.engine=openai), whose weights "
          "are never synced with the trained model: off-policy after the first update", file=sys.stderr)
    return get_engine("openai", base_url=r.engine_base_url, model=r.engine_model or cfg.model.name,
                      tokenizer=tokenizer, max_concurrency=max(1, cfg.env.concurrency))


def make_envs(cfg: C.Config, tasks: Sequence[Any], count: int, *, prefix: str = "w",
              fault_seed: int | None = -1) -> tuple[list[Any], Any]:
    """``count`` tool environments over one in-process tool server (returned too: closing it deletes
    its file sandboxes). ``prefix`` names their episodes; ``fault_seed`` -1 = ``env.fault_seed`` (None:
    each episode's faults follow its reset seed, as the held-out evaluation wants)."""
    import gymnasium as gym

    import reflrl.envs  # noqa: F401  (registers the env ids)
    from reflrl.envs.tool_server import create_app

    e = cfg.env
    policy = e.fault_exposure == "policy"
    retry = {"max_attempts": e.retry.policy_max_attempts if policy else e.retry.max_attempts,
             "budget_s": e.retry.budget_s}
    app = create_app()
    envs = [gym.make(e.id, dataset=list(tasks), faults=e.faults or None,
                     fault_seed=e.fault_seed if fault_seed == -1 else fault_seed,
                     seed=cfg.train.seed + k, reward=e.reward, parser=e.parser, prompt_style=cfg.data.prompt_style,
                     max_steps=e.max_steps, retry=retry, fault_exposure=e.fault_exposure,
                     turn_seconds=e.turn_seconds, triage=e.triage, app=app, episode_prefix=f"{prefix}{k}", think=think_of(cfg)).unwrapped
            for k in range(count)]
    return envs, app.server


def build_components(cfg: C.Config, train_tasks: Sequence[Any], *, say: Callable[[str], None] = lambda _m: None,
                     engine: EngineFactory | None = None, model: torch.nn.Module | None = None, tokenizer: Any = None,
                     env_factory: EnvFactory | None = None, critic: Any = None) -> Components:
    """Load the policy and build its engines, the critic of the variant and the environments; a part
    given is used as it is.

    ``engine``: a factory ``(model, tokenizer) -> RolloutEngine`` used for rollouts, reflection
    retries and evaluation alike (tests pass a scripted one); default: the transformers engine.
    ``model`` and ``tokenizer`` (both or neither): the policy, on its device; ``env_factory``: ``(cfg, tasks,
    count) -> (envs, server or None)`` (default :func:`make_envs`); ``critic``: the variant's critic."""
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.engines.trunk_cache import TrunkCache

    if (model is None) != (tokenizer is None):
        raise C.ConfigError("Trainer: pass model and tokenizer together (or neither, to load model.name)")
    if critic is None and uses_endpoint(cfg):  # its endpoint is checked now, before the policy loads
        critic = build_critic(cfg)
    if model is None:
        model, tok, precision, load_s = load_policy(cfg, say)
    else:
        tok, load_s = tokenizer, 0.0
        precision = resolve_precision(str(next(model.parameters()).dtype).removeprefix("torch."),
                                      next(model.parameters()).device)
    packed = attention = matmul = None
    if engine is not None:
        rollout_engine = eval_engine = engine(model, tok)
    else:
        r = cfg.rollout  # continuous batching (rollout.continuous) within a KV budget
        on_cpu = next(model.parameters()).device.type == "cpu"
        packed = resolve_packed(r.packed_weights, available=None if on_cpu else False)
        say(packed.log_line())
        attention = resolve_attention(r.decode_attention) if on_cpu else None
        if attention is not None:
            say(attention.log_line())
        matmul = resolve_matmul(r.decode_matmul) if on_cpu else None
        if matmul is not None:
            say(matmul.log_line())
        pool = {"continuous": r.continuous, "packed": packed.enabled,
                "attention": attention.kernel if attention is not None else None, "matmul": matmul,
                "kv_budget_bytes": None if r.kv_budget_mb is None else int(r.kv_budget_mb * 2**20)}
        rollout_engine = TransformersEngine(model, tok, max_batch_size=max(64, r.n * r.batch_prompts), **pool)
        # held-out evaluations see the same prompts each time: the frozen bottom layers run once per prompt
        eval_engine = TransformersEngine(model, tok, max_batch_size=64, trunk_cache=TrunkCache(model), **pool)
    variant = variant_of(cfg)  # Tool-ReRL variant (reflection.variant): its critic when it repairs failures
    if variant.reflect and critic is None:
        critic = build_critic(cfg, rollout_engine, tok)
    elif not variant.reflect:
        critic = None
    # the RL rollouts meet env.faults at env.train_fault_scale times their rates (the evaluations, as given)
    train_cfg = replace(cfg, env=replace(cfg.env, faults=C.train_faults(cfg.env)))
    envs, server = (env_factory or make_envs)(train_cfg, train_tasks, cfg.rollout.n * cfg.rollout.batch_prompts)
    spec = RolloutSpec.from_config(cfg, fmt=answer_format(cfg), think=think_of(cfg))
    return Components(model=model, tokenizer=tok, precision=precision, engine=rollout_engine, eval_engine=eval_engine,
                      remote_engine=remote_engine(cfg, tok), variant=variant, critic=critic, envs=envs,
                      tool_server=server, rollout=spec, load_s=load_s,
                      decode_weights=packed, decode_attention=attention, decode_matmul=matmul)


def checkpoint_config(run: str | Path, checkpoint: str, overrides: Sequence[str] = ()) -> C.Config:
    """A run folder's config pointed at one of its checkpoints (``model.init_from``), with faults off
    and ``overrides`` applied; sets torch's threads to ``train.threads`` as a run does. For the
    scripts that study a checkpoint (through :func:`checkpoint_components`).
    Raises FileNotFoundError naming the run's checkpoints when ``checkpoint`` is not one of them."""
    run = Path(run)
    ck = run / "checkpoints" / checkpoint
    if not ck.is_dir():
        have = ", ".join(sorted(x.name for x in (run / "checkpoints").glob("step_*"))) or "none"
        raise FileNotFoundError(f"no checkpoint {ck} (the run's checkpoints: {have})")
    cfg = C.load_config(run / "config.yaml", [f"model.init_from={ck}", "env.faults=", *overrides])
    fix_threads(cfg.train.threads)  # as a run does (--set train.threads=1 beside another process)
    return cfg


def checkpoint_components(run: str | Path, checkpoint: str, overrides: Sequence[str] = ()
                          ) -> tuple[C.Config, dict[str, list], Components]:
    """(config, data splits, components) of a run folder's checkpoint, as :func:`checkpoint_config` sets it
    up: what the scripts that study a checkpoint (scripts/rl_headroom.py, reflection_repairs.py,
    teacher_probe.py, heldout_churn.py) evaluate and sample with. Raises FileNotFoundError as
    :func:`checkpoint_config` does."""
    from reflrl.train.data import splits_from_config

    cfg = checkpoint_config(run, checkpoint, overrides)
    splits = splits_from_config(cfg.data)
    return cfg, splits, build_components(cfg, splits["train"])
