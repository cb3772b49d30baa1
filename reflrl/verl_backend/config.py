"""Our Config (reflrl.config) + scale-out settings -> a verl 0.9.1 trainer config, validated by verl.

A recipe file (``configs/verl/*.yaml``) has two sections::

    reflrl:   # our Config (model, data, env, rollout, algo, train), checked by reflrl.config.validate
      ...
    verl:     # scale-out settings (VerlSettings below): GPUs, nodes, mini-batch, parallelism, files
      n_gpus_per_node: 8
      ...
      overrides: ["trainer.logger=[console,tensorboard]"]   # raw verl keys, applied last

:func:`build_verl_config` composes verl's own default trainer config (``verl/trainer/config/
ppo_trainer.yaml`` through Hydra, exactly what ``python -m verl.trainer.main_ppo`` starts from), sets
the keys our settings map to (table in docs/scale-out.md), adds a top-level ``reflrl`` section (the
agent loop's episode defaults) and runs verl's validation (:func:`validate_verl_config`):
``verl.utils.config.validate_config`` (batch divisibility by GPUs, micro-batch settings, the actor
dataclass) plus conversion of the algorithm, rollout and critic sections to verl's config dataclasses
(``omega_conf_to_dataclass``), which reject unknown or ill-typed keys.

Without verl installed (``make install`` alone; the dry run), the default config is reflrl's copy of the
same composition (``verl_ppo_trainer.yaml``, :data:`DEFAULT_SNAPSHOT`; a test checks it equals verl's
own), unknown keys are still refused, and only our own checks run: verl's need verl.

Mapping decisions (why):

- ``algo.policy_loss`` "clip_higher"/"ppo_clip" -> verl ``vanilla`` (same math, tested); "tool_rerl" ->
  ``reflrl_tool_rerl`` with ``algorithm.rollout_correction`` = token-level, untruncated weights (the
  carrier of the behaviour log-probs, see :mod:`reflrl.verl_backend.losses`) and
  ``rollout.calculate_log_probs=true``.
- ``algo.dual_clip_c`` null (off) -> ``clip_ratio_c = 1e9``: verl's losses always apply the dual clip;
  with c = 1e9 it never binds.
- ``algo.advantage`` "grpo" / "dr_grpo" -> our ``reflrl_grpo`` / ``reflrl_dr_grpo`` estimators
  (:mod:`reflrl.verl_backend.advantages`: masked env-fault rollouts leave their group, as in the CPU
  trainer); "rloo" / "gae" -> verl's own.
- ``rollout.batch_prompts`` -> ``data.train_batch_size`` (prompts); ``rollout.n`` -> ``rollout.n``;
  ``rollout.max_new_tokens`` -> ``data.max_response_length``; ``verl.ppo_mini_batch_size`` is in
  prompts, as in verl (it multiplies by n).
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

import reflrl.algos  # noqa: F401  (registers "tool_rerl", so reflrl.config.validate accepts it)
from reflrl.config import Config, ConfigError, config_from_dict, validate

from reflrl.algos.importance import DEFAULT_LOG_CAP

from . import VERL_VERSION, require_verl, verl_available
from .advantages import DEFAULT_EPS

REWARD_FILE = str(Path(__file__).with_name("reward.py"))
#: verl's default trainer config, composed (module doc): used when verl is not installed
DEFAULT_SNAPSHOT = Path(__file__).with_name("verl_ppo_trainer.yaml")

POLICY_LOSS_MAP = {"clip_higher": "vanilla", "ppo_clip": "vanilla", "tool_rerl": "reflrl_tool_rerl"}
ADVANTAGE_MAP = {"grpo": "reflrl_grpo", "dr_grpo": "reflrl_dr_grpo", "rloo": "rloo", "gae": "gae"}
DUAL_CLIP_OFF = 1.0e9


#: episode settings with no counterpart in our Config (the rest come from it, see :func:`episode_defaults`)
VERL_ONLY_EPISODE_KEYS = {"mark_unrepaired"}


@dataclass
class VerlSettings:
    """Scale-out settings of a verl run (the ``verl:`` section of a recipe)."""

    n_gpus_per_node: int = 8
    nnodes: int = 1
    ppo_mini_batch_size: int = 256
    micro_batch_size_per_gpu: int | None = None  # null: algo.micro_batch_size
    log_prob_micro_batch_size_per_gpu: int = 8
    max_prompt_length: int = 2048
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    rollout_engine: str = "vllm"
    model_dtype: str | None = None  # null: from model.dtype ('auto' = bfloat16)
    critic_lr: float = 1.0e-5
    train_files: str = "runs/verl_data/train.parquet"
    val_files: str = "runs/verl_data/val.parquet"
    total_epochs: int = 1
    project_name: str = "reflrl"
    experiment_name: str = "run"
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    agent_loop: str = "reflrl_tool_agent"
    reflection: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "VerlSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d or {})
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"verl: unknown settings {unknown}; known: {sorted(names)}")
        s = cls(**d)
        for k in ("n_gpus_per_node", "nnodes", "ppo_mini_batch_size", "micro_batch_size_per_gpu",
                  "tensor_model_parallel_size", "max_prompt_length", "total_epochs"):
            if k == "micro_batch_size_per_gpu" and s.micro_batch_size_per_gpu is None:
                continue
            if not isinstance(getattr(s, k), int) or getattr(s, k) < 1:
                raise ConfigError(f"verl.{k}: must be an integer >= 1, got {getattr(s, k)!r}")
        if s.model_dtype not in (None, "bfloat16", "float16"):
            raise ConfigError(f"verl.model_dtype: expected bfloat16, float16 or null, got {s.model_dtype!r}")
        own = sorted(set(s.reflection) - VERL_ONLY_EPISODE_KEYS)
        if own:
            raise ConfigError(f"verl.reflection: {own} are settings of our Config; set them in the recipe's "
                              f"reflrl section (reflection.*, env.*, rollout.*); verl.reflection takes only "
                              f"{sorted(VERL_ONLY_EPISODE_KEYS)}")
        if not 0 < float(s.gpu_memory_utilization) <= 1:
            raise ConfigError(f"verl.gpu_memory_utilization: must be in (0, 1], got {s.gpu_memory_utilization}")
        return s


@dataclass
class Recipe:
    """A parsed recipe: our Config and the verl settings."""

    cfg: Config
    verl: VerlSettings


def _split_overrides(overrides: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``reflrl.algo.lr=1e-6`` / ``algo.lr=1e-6`` -> our overrides; ``verl.n_gpus_per_node=4`` -> verl
    settings; anything else (``actor_rollout_ref....=``) -> raw verl overrides."""
    ours, verl = [], []
    our_sections = {f.name for f in dataclasses.fields(Config)}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        head = key.split(".", 1)[0]
        if head == "reflrl":
            ours.append(o.split(".", 1)[1])
        elif head in our_sections:
            ours.append(o)
        else:
            verl.append(o)
    return ours, verl


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file and apply dotted overrides (see :func:`_split_overrides`)."""
    from reflrl.config import parse_override

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"recipe {str(path)!r} does not exist") from None
    if not isinstance(raw, dict) or set(raw) - {"reflrl", "verl"}:
        raise ConfigError(f"{path}: a verl recipe has exactly the sections 'reflrl' and 'verl', got "
                          f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    ours, rest = _split_overrides(overrides)
    known = set(config_keys())
    base = {sec: {k: v for k, v in d.items() if f"{sec}.{k}" in known} for sec, d in VERL_BASE.items()}
    tree = _merge(base, dict(raw.get("reflrl") or {}))
    for o in ours:
        keys, value = parse_override(o)
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    cfg = validate(config_from_dict(tree))
    vs = dict(raw.get("verl") or {})
    raw_verl = []
    for o in rest:
        key, _, val = o.partition("=")
        if key.startswith("verl."):
            *parents, leaf = key[len("verl."):].split(".")
            node = vs
            for k in parents:  # verl.reflection.max_attempts=1 -> vs["reflection"]["max_attempts"]
                node = node.setdefault(k, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {o!r}: verl.{k} is not a section")
            node[leaf] = yaml.safe_load(val)
        else:
            raw_verl.append(o)
    settings = VerlSettings.from_dict(vs)
    settings.overrides = list(settings.overrides) + raw_verl
    # Ray actors on other nodes read and write these: absolute, resolved on the launching machine
    settings.train_files = str(Path(settings.train_files).expanduser().resolve())
    settings.val_files = str(Path(settings.val_files).expanduser().resolve())
    return Recipe(cfg, settings)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ------------------------------------------------------------------------------------- every key
@dataclass(frozen=True)
class Decision:
    """What the verl backend does with one key of our Config (the table :data:`KEYS`).

    kind: "mapped" (reaches verl: ``note`` says where), "refused" (values verl cannot run are refused
    with ``note`` as the reason) or "not_needed" (verl has no use for it: ``note`` says why). A mapped
    key may also refuse some values (``accept`` False -> ConfigError with ``refusal``).
    accept(value, cfg, settings): the values the backend runs. probe / example: a verl config key that
    changes when the key is set to ``example`` (checked by the tests); bad: a value that is refused.
    """

    kind: str
    note: str
    accept: Callable[[Any, Config, "VerlSettings"], bool] | None = None
    refusal: str = ""
    probe: str | None = None
    example: Any = None
    bad: Any = None


def _mapped(note: str, probe: str | None = None, example: Any = None, **kw: Any) -> Decision:
    return Decision("mapped", note, probe=probe, example=example, **kw)


def _refused(why: str, accept: Callable[[Any, Config, Any], bool], bad: Any) -> Decision:
    return Decision("refused", why, accept=accept, bad=bad)


def _not_needed(why: str) -> Decision:
    return Decision("not_needed", why)


def _is(*ok: Any) -> Callable[[Any, Config, Any], bool]:
    return lambda v, _c, _s: v in ok


_ARR, _ACT, _EP = "actor_rollout_ref.", "actor_rollout_ref.actor.", "reflrl."
_VERL_VARIANTS = ("grpo", "ppo", "cot", "ref", "tool_rerl")
_ONLY_POLICY = "only read with env.fault_exposure='policy', which the verl backend refuses"
_ONLY_SAMPLER = "only read with sampling.sampler != 'none' or sampling.curriculum, which the verl backend refuses"
_ONLY_WARMUP = "only read by the SFT warm-up, which the verl backend refuses (warmup.enabled must be false)"

#: every key of our Config (dotted) -> its :class:`Decision`; tests/test_verl_config.py walks the Config
#: dataclasses and fails on a field without an entry
KEYS: dict[str, Decision] = {
    # model
    "model.name": _mapped("actor_rollout_ref.model.path (and critic.model.path with a critic)",
                          _ARR + "model.path", "/models/other"),
    "model.dtype": _mapped("the compute dtype when verl.model_dtype is null: actor_rollout_ref.rollout.dtype, "
                           "actor/ref fsdp_config.dtype ('auto' = bfloat16; no other value changes them)", None, None,
                           accept=lambda v, _c, s: v in ("auto", "bfloat16") and (s.model_dtype in (None, "bfloat16") or v == "auto"),
                           refusal="verl computes in bfloat16 or float16; set model.dtype to auto or bfloat16 "
                                   "and the GPU precision with verl.model_dtype", bad="float32"),
    "model.trainable": _mapped("'all' trains every weight (FSDP); 'lora' -> actor_rollout_ref.model.lora_rank / "
                               "lora_alpha / target_modules", _ARR + "model.lora_rank", "lora",
                               accept=_is("all", "lora"),
                               refusal="verl trains every weight ('all') or a LoRA adapter ('lora'); it cannot "
                                       "freeze layers, so 'none' and 'top_layers:K' are CPU-trainer settings",
                               bad="top_layers:6"),
    "model.trainable_dtype": _mapped("actor_rollout_ref.actor.fsdp_config.model_dtype (the master weights: "
                                     "float32 -> fp32, null -> the compute dtype)",
                                     _ACT + "fsdp_config.model_dtype", None),
    "model.lora_r": _mapped("actor_rollout_ref.model.lora_rank with model.trainable=lora"),
    "model.lora_alpha": _mapped("actor_rollout_ref.model.lora_alpha with model.trainable=lora (null = 2 x lora_r)"),
    "model.lora_dropout": _refused("verl 0.9.1's LoRA has no dropout setting", _is(0.0, 0), 0.1),
    "model.init_from": _refused("a reflrl checkpoint folder (trainable.pt) is not a model verl can load; point "
                                "model.name at a Hugging Face folder instead", _is(None), "runs/x/checkpoints/step_1"),
    # data: the launcher writes the split as parquet (verl.train_files / verl.val_files)
    "data.source": _mapped("the tasks the launcher writes to verl.train_files / verl.val_files"),
    "data.path": _mapped("the tasks the launcher writes to verl.train_files / verl.val_files"),
    "data.fmt": _mapped("the tasks the launcher writes to verl.train_files / verl.val_files"),
    "data.n_train": _mapped("rows of verl.train_files"),
    "data.n_val": _mapped("rows of verl.val_files (0: the first training tasks, at most 8)"),
    "data.n_test": _not_needed("verl has no held-out test split; score a checkpoint with `reflrl eval`"),
    "data.kinds": _mapped("the task kinds written to the parquet files"),
    "data.seed": _mapped("data.seed (verl's shuffling) and the generator of the written tasks", "data.seed", 7),
    "data.prompt_style": _mapped("the rows' prompts and reflrl.prompt_style (the agent loop's env)",
                                 _EP + "prompt_style", "compact"),
    # env: the agent loop's episode settings (the top-level reflrl section of verl's config)
    "env.id": _not_needed("the agent loop picks the env class by each task's kind (multi_turn or not)"),
    "env.faults": _mapped("reflrl.faults", _EP + "faults", "rate_limit=0.1"),
    "env.fault_seed": _mapped("reflrl.fault_seed (null: faults follow reflrl.seed)", _EP + "fault_seed", 5),
    "env.reward": _mapped("reflrl.reward and each row's extra_info.reward", _EP + "reward", "fine"),
    "env.parser": _mapped("reflrl.parser and each row's extra_info.parser", _EP + "parser", "pythonic"),
    "env.max_steps": _mapped("reflrl.max_steps (the env's assistant-message limit)", _EP + "max_steps", 3),
    "env.retry.max_attempts": _mapped("reflrl.retry_max_attempts", _EP + "retry_max_attempts", 2),
    "env.retry.budget_s": _mapped("reflrl.retry_budget_s", _EP + "retry_budget_s", 5.0),
    "env.retry.policy_max_attempts": _not_needed(_ONLY_POLICY),
    "env.fault_exposure": _refused("the verl agent loop meets faults through the tool client's retries "
                                   "('client'); 'policy' is a CPU-trainer setting", _is("client"), "policy"),
    "env.turn_seconds": _not_needed(_ONLY_POLICY),
    "env.train_fault_scale": _refused("the verl agent loop's episodes meet env.faults at the rates given; a "
                                      "training-only rate is a CPU-trainer setting", _is(1.0), 3.0),
    "env.triage": _refused("the verl agent loop masks the episodes whose faults the client gave up on",
                           _is(True), False),
    "env.train_fault_cap": _not_needed("only read with env.train_fault_scale != 1, which the verl backend refuses"),
    "env.eval_fault_seed": _not_needed("held-out evaluation with faults is `reflrl eval`; verl's validation "
                                       "episodes use the training fault seeds"),
    "env.concurrency": _not_needed("verl runs the episodes of a batch concurrently in its agent-loop workers "
                                   "(actor_rollout_ref.rollout.agent.num_workers)"),
    # rollout
    "rollout.n": _mapped("actor_rollout_ref.rollout.n", _ARR + "rollout.n", 3),
    "rollout.batch_prompts": _mapped("data.train_batch_size", "data.train_batch_size", 512),
    "rollout.temperature": _mapped("actor_rollout_ref.rollout.temperature", _ARR + "rollout.temperature", 0.7),
    "rollout.top_p": _mapped("actor_rollout_ref.rollout.top_p", _ARR + "rollout.top_p", 0.9),
    "rollout.max_new_tokens": _mapped("data.max_response_length", "data.max_response_length", 256),
    "rollout.answer_cap": _refused("verl caps every response at data.max_response_length "
                                   "(rollout.max_new_tokens); per-task caps are a CPU-trainer setting",
                                   _is(None), 1.5),
    "rollout.stop_at_complete": _refused("verl's rollout stops at the end of the turn or at the length cap; "
                                         "stopping at the end of the tool-call block is a CPU-trainer setting",
                                         _is(False), True),
    "rollout.max_turns": _mapped("reflrl.max_turns (assistant turns of a multi-turn episode)", _EP + "max_turns", 4),
    "rollout.max_total_tokens": _mapped("reflrl.max_total_tokens (prompt + response tokens of a multi-turn "
                                        "episode)", _EP + "max_total_tokens", 3000),
    "rollout.engine": _refused("verl samples with its own rollout engine (verl.rollout_engine); "
                               "rollout.engine is the CPU trainer's", lambda v, _c, s: v in ("transformers", s.rollout_engine),
                               "openai"),
    "rollout.engine_base_url": _not_needed("only read with rollout.engine='openai', which the verl backend refuses"),
    "rollout.engine_model": _not_needed("only read with rollout.engine='openai', which the verl backend refuses"),
    "rollout.engine_off_policy": _not_needed("only read with rollout.engine='openai', which the verl backend refuses"),
    "rollout.continuous": _not_needed("verl's rollout engine (vLLM, SGLang) batches continuously itself; this is "
                                      "the CPU engine's decode loop"),
    "rollout.packed_weights": _not_needed("verl's rollout engine runs on GPUs with its own kernels; this is the CPU "
                                          "engine's decode weights"),
    "rollout.decode_attention": _not_needed("verl's rollout engine runs on GPUs with its own kernels; this is the "
                                            "CPU engine's decode attention"),
    "rollout.decode_matmul": _not_needed("verl's rollout engine runs on GPUs with its own kernels; this is the "
                                         "CPU engine's matmul kernel"),
    "rollout.kv_budget_mb": _not_needed("verl sizes its rollout engine's KV cache (actor_rollout_ref.rollout."
                                        "gpu_memory_utilization); this is the CPU engine's budget"),
    # algo
    "algo.advantage": _mapped("algorithm.adv_estimator", "algorithm.adv_estimator", "rloo"),
    "algo.adv_eps": _refused(f"the verl estimators reflrl_grpo / reflrl_dr_grpo divide by std + {DEFAULT_EPS:g} "
                             "(verl passes no epsilon from the config)", _is(DEFAULT_EPS), 1e-4),
    "algo.gamma": _mapped("algorithm.gamma", "algorithm.gamma", 0.9),
    "algo.lam": _mapped("algorithm.lam", "algorithm.lam", 0.9),
    "algo.policy_loss": _mapped("actor.policy_loss.loss_mode", _ACT + "policy_loss.loss_mode", "tool_rerl"),
    "algo.clip_low": _mapped("actor.clip_ratio_low (and clip_ratio)", _ACT + "clip_ratio_low", 0.1),
    "algo.clip_high": _mapped("actor.clip_ratio_high", _ACT + "clip_ratio_high", 0.3),
    "algo.dual_clip_c": _mapped("actor.clip_ratio_c (null = 1e9: never binds)", _ACT + "clip_ratio_c", 3.0),
    "algo.loss_agg": _mapped("actor.loss_agg_mode", _ACT + "loss_agg_mode", "seq-mean-token-mean"),
    "algo.kl_coef": _mapped("actor.use_kl_loss + actor.kl_loss_coef", _ACT + "kl_loss_coef", 0.01),
    "algo.kl_estimator": _mapped("actor.kl_loss_type", _ACT + "kl_loss_type", "k1"),
    "algo.entropy_coef": _mapped("actor.entropy_coeff", _ACT + "entropy_coeff", 0.01),
    "algo.sft_coef": _refused("verl 0.9.1's actor update has no supervised loss on demonstrations mixed in; "
                              "the anchor is a CPU-trainer setting", _is(0.0, 0), 1.0),
    "algo.sft_batch": _not_needed("only read with algo.sft_coef > 0, which the verl backend refuses"),
    "algo.value_coef": _not_needed("verl trains the critic as its own model with its own optimiser "
                                   "(verl.critic_lr), so there is no shared loss to weight"),
    "algo.value_clip": _mapped("critic.cliprange_value with algo.advantage=gae (null = 1e9)"),
    "algo.lr": _mapped("actor.optim.lr", _ACT + "optim.lr", 3e-6),
    "algo.weight_decay": _mapped("actor.optim.weight_decay", _ACT + "optim.weight_decay", 0.1),
    "algo.grad_clip": _mapped("actor.grad_clip (0 = 1e9: no clipping)", _ACT + "grad_clip", 0.5),
    "algo.epochs_per_batch": _mapped("actor.ppo_epochs", _ACT + "ppo_epochs", 2),
    "algo.activation_budget_mb": _not_needed("verl sizes its micro-batches by actor.ppo_micro_batch_size_per_gpu "
                                             "(or its dynamic batch size); this is the CPU trainer's budget"),
    "algo.micro_batch_size": _mapped("actor.ppo_micro_batch_size_per_gpu when verl.micro_batch_size_per_gpu "
                                     "is null (sequences per forward/backward, per GPU)",
                                     _ACT + "ppo_micro_batch_size_per_gpu", 2),
    "algo.downsample_m": _refused("max-variance down-sampling runs in the CPU trainer only (on verl 0.9.1 its "
                                  "place is the v1 trainer's sampler, not wired)", _is(0), 2),
    "algo.prefilter_k": _refused("the pre-rollout filter runs in the CPU trainer only (on verl 0.9.1 its place "
                                 "is the v1 trainer's sampler, not wired)", _is(0), 1),
    # sampling (DSCL)
    "sampling.sampler": _refused("the group filters (DAPO's dynamic sampling, the DSCL samplers) run in the CPU "
                                 "trainer only; verl's algorithm.filter_groups is not wired", _is("none"), "dapo"),
    "sampling.curriculum": _refused("the DSCL curriculum (TDCL) runs in the CPU trainer only", _is(False), True),
    **{f"sampling.{k}": _not_needed(_ONLY_SAMPLER) for k in (
        "warmup_gate", "refill", "max_refill_rounds", "t_mean", "t_var", "unit_scale", "keep_a", "keep_b1", "keep_b2",
        "keep_c1", "keep_c2", "smv_keep", "smr_low", "smr_high", "reset_history_on_stage", "format_threshold",
        "name_threshold", "key_threshold", "window", "reset_window_on_stage")},
    # warm-up
    "warmup.enabled": _refused("the verl backend runs RL only; warm up with the CPU trainer and point "
                               "model.name at the result", _is(False), "auto"),
    **{f"warmup.{k}": _not_needed(_ONLY_WARMUP) for k in (
        "format_rate_threshold", "probe_n", "steps", "lr", "batch_size", "time_budget_min", "eval_after",
        "critique_share", "critique_reveal", "rename_share")},
    # train
    "train.steps": _mapped("trainer.total_training_steps", "trainer.total_training_steps", 5),
    "train.time_budget_min": _refused("verl has no time budget; stop it with train.steps", _is(None), 30.0),
    "train.rl_minutes": _refused("verl has no equal-time stopping rule; stop it with train.steps", _is(None), 5.0),
    "train.eval_before": _not_needed("verl has no held-out test split; score a checkpoint with `reflrl eval`"),
    "train.eval_every": _mapped("trainer.test_freq (0 = -1: never)", "trainer.test_freq", 3),
    "train.save_every": _mapped("trainer.save_freq (0 = -1: at the end only)", "trainer.save_freq", 3),
    "train.keep_checkpoints": _mapped("trainer.max_actor_ckpt_to_keep and max_critic_ckpt_to_keep",
                                      "trainer.max_actor_ckpt_to_keep", 5),
    "train.log_every": _refused("verl logs every step", _is(1), 5),
    "train.log_rollouts": _refused("on the verl backend use verl's own rollout dump, the verl override "
                                   "trainer.rollout_data_dir=DIR", _is(False), True),
    "train.seed": _mapped("reflrl.seed (the episodes' env and fault seeds, per dataset index and rollout)",
                          _EP + "seed", 3),
    "train.out_dir": _mapped("trainer.default_local_dir (absolute): OUT_DIR/RUN_NAME", "trainer.default_local_dir",
                             "/tmp/elsewhere"),
    "train.run_name": _mapped("trainer.default_local_dir's last folder (null = verl.experiment_name)",
                              "trainer.default_local_dir", "named"),
    "train.device": _refused("verl places its workers on GPUs through Ray (verl.n_gpus_per_node); verl 0.9.1 "
                             "cannot train on a CPU", _is("auto", "cuda"), "cpu"),
    "train.threads": _not_needed("torch CPU threads of the CPU trainer; verl's workers run on GPUs"),
    # reflection (Tool-ReRL)
    "reflection.variant": _mapped("reflection on or off in the agent loop (reflrl.max_attempts; 0 for grpo, ppo, "
                                  "cot) and the loss (tool_rerl -> reflrl_tool_rerl)", _EP + "max_attempts", "grpo",
                                  accept=lambda v, _c, _s: v in _VERL_VARIANTS,
                                  refusal=f"the verl backend runs the variants {', '.join(_VERL_VARIANTS)}; "
                                          "cot_is, external, external_is and dpo are CPU-trainer variants",
                                  bad="dpo"),
    "reflection.critic": _mapped("reflrl.critic (rule or llm)", _EP + "critic", "llm",
                                 accept=_is("rule", "llm"),
                                 refusal="the 'policy' critic needs the policy model inside the agent loop, which "
                                         "verl's rollout workers do not have", bad="policy"),
    "reflection.critic_base_url": _mapped("reflrl.critic_base_url (critic: llm)", _EP + "critic_base_url",
                                          "http://127.0.0.1:9000/v1"),
    "reflection.critic_model": _mapped("reflrl.critic_model (critic: llm)", _EP + "critic_model", "judge"),
    "reflection.critic_timeout_s": _mapped("reflrl.critic_timeout_s (critic: llm)", _EP + "critic_timeout_s", 10.0),
    "reflection.reveal": _mapped("reflrl.reveal (the rule critic's disclosure)", _EP + "reveal", "value"),
    "reflection.max_attempts": _mapped("reflrl.max_attempts (retries under q*) for a reflecting variant",
                                       _EP + "max_attempts", 3),
    "reflection.max_per_step": _refused("the agent loop reflects on every failed episode; a per-step cap "
                                        "is a CPU-trainer setting", _is(0), 4),
    "reflection.eval_policy_errors": _not_needed("the CPU trainer's held-out evaluation under faults; verl's "
                                                 "validation does not reflect"),
    "reflection.reflect_on": _mapped("reflrl.reflect_on", _EP + "reflect_on", "env_fault"),
    "reflection.mode": _mapped("reflrl.mode (q* rendering)", _EP + "mode", "append"),
    "reflection.group": _refused("on verl a repair takes the failed episode's place in its group ('replace')",
                                 _is("replace"), "add"),
    "reflection.think": _mapped("reflrl.think (a <think> block in the prompts)", _EP + "think", True),
    "reflection.level": _mapped("the loss: reflrl_tool_rerl (sequence), _token, _seqmean"),
    "reflection.log_cap": _refused(f"the verl losses are registered with log_cap {DEFAULT_LOG_CAP} "
                                   "(reflrl.verl_backend.losses.register_losses)", _is(DEFAULT_LOG_CAP), 3.0),
    "reflection.dpo_beta": _not_needed("only read by the 'dpo' variant, which the verl backend refuses"),
}

#: what a verl recipe's ``reflrl:`` section starts from (over the code defaults): the settings the verl
#: backend runs, so CPU-trainer defaults (a frozen bottom, answer caps, the warm-up, time budgets...)
#: are off unless the recipe sets them -- and then they are refused with the reason in :data:`KEYS`
VERL_BASE: dict[str, dict[str, Any]] = {
    "model": {"trainable": "all", "dtype": "auto"},
    "env": {"fault_exposure": "client"},
    "rollout": {"answer_cap": None, "stop_at_complete": False, "engine": "transformers"},
    "algo": {"downsample_m": 0, "prefilter_k": 0, "adv_eps": DEFAULT_EPS},
    "sampling": {"sampler": "none", "curriculum": False},
    "warmup": {"enabled": False},
    "train": {"time_budget_min": None, "rl_minutes": None, "log_every": 1, "log_rollouts": False, "device": "auto"},
    "reflection": {"variant": "grpo", "critic": "rule", "max_per_step": 0, "group": "replace", "log_cap": DEFAULT_LOG_CAP},
}


def config_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of ``cls`` (nested sections walked)."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += config_keys(tp, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _value(cfg: Config, key: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def refusals(cfg: Config, s: "VerlSettings") -> list[str]:
    """One line per key of ``cfg`` whose value the verl backend cannot run (:data:`KEYS`), and per key
    without a decision."""
    out = []
    for key in config_keys():
        d = KEYS.get(key)
        if d is None:
            out.append(f"{key}: no decision for the verl backend (reflrl.verl_backend.config.KEYS)")
            continue
        present, v = _value(cfg, key)
        if present and d.accept is not None and not d.accept(v, cfg, s):
            out.append(f"{key}={v!r}: {d.refusal or d.note}")
    return out


def rollout_correction_settings(loss_mode: str) -> dict[str, Any] | None:
    """The fields of verl's ``algorithm.rollout_correction`` for a loss mode: for our ``reflrl_tool_rerl*``
    losses token-level, untruncated IS weights (the behaviour log-prob carrier); None otherwise."""
    from .losses import LOSS_LEVELS, UNTRUNCATED_THRESHOLD

    if loss_mode not in LOSS_LEVELS:
        return None
    return {"rollout_is": "token", "rollout_is_threshold": UNTRUNCATED_THRESHOLD,
            "rollout_is_batch_normalize": False, "rollout_rs": None, "bypass_mode": False}


def rollout_correction_for(loss_mode: str):
    """:func:`rollout_correction_settings` as verl's ``RolloutCorrectionConfig`` (needs verl)."""
    require_verl()
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    rc = rollout_correction_settings(loss_mode)
    return None if rc is None else RolloutCorrectionConfig(**rc)


def variant_loss(cfg: Config) -> tuple[str, bool]:
    """(verl loss mode, reflect?) of ``cfg``: the variant decides reflection and, with the importance
    weight (tool_rerl), the loss; otherwise ``algo.policy_loss`` does."""
    from reflrl.recovery.variants import variant_of

    a, rf = cfg.algo, cfg.reflection
    v = variant_of(cfg)
    if a.policy_loss not in POLICY_LOSS_MAP:
        raise ConfigError(f"algo.policy_loss={a.policy_loss!r} has no verl counterpart; use one of "
                          f"{sorted(POLICY_LOSS_MAP)}")
    loss_mode = POLICY_LOSS_MAP["tool_rerl" if v.importance else a.policy_loss]
    if loss_mode == "reflrl_tool_rerl":
        # the ratio level of eq. 2, as the CPU trainer applies it (reflection.level)
        from .losses import LOSS_LEVELS

        by_level = {lv: name for name, lv in LOSS_LEVELS.items()}
        if rf.level not in by_level:
            raise ConfigError(f"reflection.level={rf.level!r} has no verl loss; use one of {sorted(by_level)}")
        loss_mode = by_level[rf.level]
    if v.name == "ppo" and a.advantage != "gae":
        raise ConfigError("reflection.variant='ppo' is PPO with a value function: set algo.advantage=gae")
    return loss_mode, v.reflect


def compute_dtype(cfg: Config, s: VerlSettings) -> str:
    """The GPU compute dtype: ``verl.model_dtype``, else ``model.dtype`` ('auto' = bfloat16)."""
    return s.model_dtype or ("bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype)


def verl_keys(cfg: Config, s: VerlSettings) -> dict[str, Any]:
    """The dotted verl keys our settings set (before the raw overrides). Raises ConfigError listing
    every key whose value the verl backend cannot run (:data:`KEYS`)."""
    a, r, m = cfg.algo, cfg.rollout, cfg.model
    if a.advantage not in ADVANTAGE_MAP:
        raise ConfigError(f"algo.advantage={a.advantage!r} has no verl counterpart; use one of {sorted(ADVANTAGE_MAP)}")
    bad = refusals(cfg, s)
    if bad:
        raise ConfigError("the verl backend cannot run these settings (reflrl.verl_backend.config.KEYS):\n  "
                          + "\n  ".join(bad))
    loss_mode, _reflect = variant_loss(cfg)
    dtype = compute_dtype(cfg, s)
    arr, act = "actor_rollout_ref.", "actor_rollout_ref.actor."
    micro = s.micro_batch_size_per_gpu if s.micro_batch_size_per_gpu is not None else a.micro_batch_size
    if micro != a.micro_batch_size:
        raise ConfigError(f"verl.micro_batch_size_per_gpu={micro} and algo.micro_batch_size={a.micro_batch_size} "
                          "name the same thing (sequences per forward/backward on a GPU); set one of them")
    out_root = Path(cfg.train.out_dir).expanduser().resolve()
    k: dict[str, Any] = {
        "data.train_files": s.train_files,
        "data.val_files": s.val_files,
        "data.train_batch_size": r.batch_prompts,
        "data.max_prompt_length": s.max_prompt_length,
        "data.max_response_length": r.max_new_tokens,
        "data.seed": cfg.data.seed,
        "data.return_raw_chat": True,
        arr + "model.path": m.name,
        arr + "model.lora_rank": m.lora_r if m.trainable == "lora" else 0,
        act + "strategy": "fsdp",
        act + "fsdp_config.dtype": dtype,
        act + "fsdp_config.model_dtype": "fp32" if m.trainable_dtype == "float32" else dtype,
        arr + "ref.fsdp_config.dtype": dtype,
        act + "ppo_mini_batch_size": s.ppo_mini_batch_size,
        act + "ppo_micro_batch_size_per_gpu": micro,
        act + "ppo_epochs": a.epochs_per_batch,
        act + "optim.lr": a.lr,
        act + "optim.weight_decay": a.weight_decay,
        act + "grad_clip": a.grad_clip if a.grad_clip > 0 else 1.0e9,
        act + "clip_ratio": a.clip_low,
        act + "clip_ratio_low": a.clip_low,
        act + "clip_ratio_high": a.clip_high,
        act + "clip_ratio_c": a.dual_clip_c if a.dual_clip_c is not None else DUAL_CLIP_OFF,
        act + "loss_agg_mode": a.loss_agg,
        act + "policy_loss.loss_mode": loss_mode,
        act + "use_kl_loss": a.kl_coef > 0,
        act + "kl_loss_coef": a.kl_coef,
        act + "kl_loss_type": a.kl_estimator,
        act + "entropy_coeff": a.entropy_coef,
        arr + "rollout.name": s.rollout_engine,
        arr + "rollout.dtype": dtype,
        arr + "rollout.n": r.n,
        arr + "rollout.temperature": r.temperature,
        arr + "rollout.top_p": r.top_p,
        arr + "rollout.tensor_model_parallel_size": s.tensor_model_parallel_size,
        arr + "rollout.gpu_memory_utilization": s.gpu_memory_utilization,
        arr + "rollout.log_prob_micro_batch_size_per_gpu": s.log_prob_micro_batch_size_per_gpu,
        arr + "rollout.calculate_log_probs": True,
        arr + "rollout.agent.default_agent_loop": s.agent_loop,
        arr + "ref.log_prob_micro_batch_size_per_gpu": s.log_prob_micro_batch_size_per_gpu,
        "algorithm.adv_estimator": ADVANTAGE_MAP[a.advantage],
        "algorithm.norm_adv_by_std_in_grpo": a.advantage != "dr_grpo",
        "algorithm.gamma": a.gamma,
        "algorithm.lam": a.lam,
        "algorithm.use_kl_in_reward": False,
        "critic.enable": a.advantage == "gae",
        "reward.custom_reward_function.path": REWARD_FILE,
        "reward.custom_reward_function.name": "compute_score",
        "trainer.n_gpus_per_node": s.n_gpus_per_node,
        "trainer.nnodes": s.nnodes,
        "trainer.total_epochs": s.total_epochs,
        "trainer.total_training_steps": cfg.train.steps,
        "trainer.project_name": s.project_name,
        "trainer.experiment_name": s.experiment_name,
        "trainer.logger": list(s.logger),
        "trainer.save_freq": cfg.train.save_every if cfg.train.save_every > 0 else -1,
        "trainer.test_freq": cfg.train.eval_every if cfg.train.eval_every > 0 else -1,
        "trainer.max_actor_ckpt_to_keep": cfg.train.keep_checkpoints,
        "trainer.max_critic_ckpt_to_keep": cfg.train.keep_checkpoints,
        # Ray actors on other nodes write here: absolute (storage every node can reach, docs/scale-out.md)
        "trainer.default_local_dir": str(out_root / (cfg.train.run_name or s.experiment_name)),
    }
    if m.trainable == "lora":
        from reflrl.trainable import LORA_TARGETS

        k[arr + "model.lora_alpha"] = m.lora_alpha if m.lora_alpha is not None else 2 * m.lora_r
        k[arr + "model.target_modules"] = list(LORA_TARGETS)
    if a.advantage == "gae":
        k.update({
            "critic.optim.lr": s.critic_lr,
            "critic.cliprange_value": a.value_clip if a.value_clip is not None else 1.0e9,
            "critic.ppo_micro_batch_size_per_gpu": micro,
            "critic.ppo_mini_batch_size": s.ppo_mini_batch_size,
            "critic.model.path": m.name,
        })
    for f, v in (rollout_correction_settings(loss_mode) or {}).items():
        k[f"algorithm.rollout_correction.{f}"] = v
    return k


def episode_defaults(cfg: Config, s: VerlSettings) -> dict[str, Any]:
    """The top-level ``reflrl`` section of the verl config: the agent loop's episode settings, from our
    Config (env, rollout, reflection, train.seed) and ``verl.reflection`` (keys with no Config counterpart)."""
    from reflrl.recovery.variants import think_of

    _loss, reflect = variant_loss(cfg)
    e, r, rf = cfg.env, cfg.rollout, cfg.reflection
    d = {"faults": e.faults, "fault_seed": e.fault_seed, "seed": cfg.train.seed,
         "reward": e.reward, "parser": e.parser, "prompt_style": cfg.data.prompt_style, "think": think_of(cfg),
         "max_steps": e.max_steps, "max_turns": r.max_turns, "max_total_tokens": r.max_total_tokens,
         "retry_max_attempts": e.retry.max_attempts, "retry_budget_s": e.retry.budget_s,
         "critic": rf.critic, "reveal": rf.reveal, "critic_base_url": rf.critic_base_url,
         "critic_model": rf.critic_model, "critic_timeout_s": rf.critic_timeout_s,
         "max_attempts": rf.max_attempts if reflect else 0, "reflect_on": rf.reflect_on, "mode": rf.mode}
    d.update(dict(s.reflection))
    from .episode import EpisodeSettings

    try:
        EpisodeSettings.from_sources(d)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"verl.reflection: {e}") from None
    return d


_DEFAULT: list[Any] = []  # verl's composed default config, composed once per process


def _compose_default():
    """A fresh copy of verl's default trainer config (composed through Hydra once per process)."""
    import copy

    if not _DEFAULT:
        _DEFAULT.append(_compose_default_uncached())
    return copy.deepcopy(_DEFAULT[0])


def _compose_default_uncached():
    """verl's own files composed through Hydra; without verl, :func:`load_default_snapshot`."""
    if not verl_available():
        return load_default_snapshot()
    verl = require_verl()
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    cdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cdir, version_base=None):
        return compose(config_name="ppo_trainer")


def load_default_snapshot():
    """reflrl's copy of verl's composed default config (:data:`DEFAULT_SNAPSHOT`), struct mode on as
    Hydra returns it (setting an unknown key is an error)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(DEFAULT_SNAPSHOT)
    OmegaConf.set_struct(conf, True)
    return conf


SNAPSHOT_HEADER = """\
# verl {version}'s default PPO trainer config: verl/trainer/config/ppo_trainer.yaml composed by Hydra, as
# `python -m verl.trainer.main_ppo` starts from it (interpolations kept). Copyright the verl authors,
# Apache License 2.0 (https://github.com/volcengine/verl). reflrl.verl_backend.config translates a recipe
# onto it when verl is not installed (`reflrl train --backend verl --dry-run`); with verl installed it
# composes verl's own files instead, and tests/test_verl_offline.py checks that the two are equal.
# Written by reflrl.verl_backend.config.write_default_snapshot() (needs verl).
"""


def write_default_snapshot(path: str | Path = DEFAULT_SNAPSHOT) -> Path:
    """Write the installed verl's composed default config to ``path`` (:data:`DEFAULT_SNAPSHOT`: after
    a verl upgrade)."""
    from omegaconf import OmegaConf

    verl = require_verl()
    text = SNAPSHOT_HEADER.format(version=verl.__version__) + OmegaConf.to_yaml(_compose_default_uncached())
    Path(path).write_text(text)
    return Path(path)


def _verl_name() -> str:
    return f"verl {require_verl().__version__}" if verl_available() else f"verl {VERL_VERSION}, reflrl's copy"


def _set(conf: Any, key: str, value: Any) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    try:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(conf, parent) if parent else conf
        if node is None or leaf not in list(node.keys()):
            raise ConfigKeyError(key)
        OmegaConf.update(conf, key, value, merge=False)
    except (ConfigAttributeError, ConfigKeyError):
        hint = _dataclass_only_hint(conf, key)
        raise ConfigError(f"verl config has no key {key!r} ({_verl_name()}); "
                          + (hint or "prefix it with '+' to add a new key")) from None


def _dataclass_only_hint(conf: Any, key: str) -> str | None:
    """For a key that verl's config dataclass of its section has but verl's YAML lacks (e.g.
    ``actor_rollout_ref.rollout.enable_sleep_mode``): how to set it (the '+' prefix)."""
    from omegaconf import OmegaConf

    try:
        from hydra.utils import get_class
    except ImportError:  # hydra comes with verl: without it, no hint
        return None
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(conf, parent) if parent else None
    target = node.get("_target_") if node is not None and hasattr(node, "get") else None
    if not target:
        return None
    try:
        cls = get_class(target)
    except Exception:  # noqa: BLE001 - no hint then
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if leaf not in fields:
        return None
    default = fields[leaf].default
    return (f"it is a field of verl's {cls.__name__} (default {default!r}) that verl's YAML does not list: "
            f"write '+{key}=VALUE' to set it")


def build_verl_config(recipe: Recipe, validate_it: bool = True):
    """The verl trainer config (an OmegaConf DictConfig) for ``recipe``; validated by verl unless
    ``validate_it`` is False. Raises ConfigError (unknown key, bad value) or verl's own
    AssertionError/ValueError from its validation, which name the problem."""
    from omegaconf import OmegaConf, open_dict

    conf = _compose_default()
    for key, value in verl_keys(recipe.cfg, recipe.verl).items():
        _set(conf, key, value)
    with open_dict(conf):
        conf.reflrl = OmegaConf.create(episode_defaults(recipe.cfg, recipe.verl))
    for o in recipe.verl.overrides:
        key, sep, val = o.partition("=")
        if not sep:
            raise ConfigError(f"verl override {o!r}: expected key=value")
        value = yaml.safe_load(val)
        if key.startswith("+"):
            with open_dict(conf):
                OmegaConf.update(conf, key[1:], value, merge=False, force_add=True)
        else:
            _set(conf, key, value)
    if validate_it:
        validate_verl_config(conf)
    return conf


def validate_verl_config(conf: Any) -> None:
    """verl's own checks: ``validate_config`` as ``verl.trainer.main_ppo.main`` runs it (with a critic
    it builds verl's CriticConfig, which loads the model's HF config: the model path must be local or
    reachable), then the algorithm and rollout sections through verl's config dataclasses, then our
    loss's requirements. Without verl installed, our loss's requirements only."""
    loss_mode = conf.actor_rollout_ref.actor.policy_loss.loss_mode
    if verl_available():
        require_verl()
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass, validate_config

        validate_config(config=conf, use_reference_policy=need_reference_policy(conf), use_critic=need_critic(conf))
        omega_conf_to_dataclass(conf.algorithm)
        omega_conf_to_dataclass(conf.actor_rollout_ref.rollout)
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

        if loss_mode not in POLICY_LOSS_REGISTRY:
            raise ConfigError(f"policy loss {loss_mode!r} is not registered in verl (is the reflrl plugin "
                              "installed? pip install -e '.[verl]')")
    if loss_mode.startswith("reflrl_tool_rerl"):
        rc = conf.algorithm.rollout_correction
        if rc.rollout_is != "token" or rc.bypass_mode or rc.rollout_rs is not None or rc.rollout_is_batch_normalize:
            raise ConfigError(f"{loss_mode} needs algorithm.rollout_correction.rollout_is=token, bypass_mode=false, "
                              "rollout_rs=null, rollout_is_batch_normalize=false (see reflrl.verl_backend.losses)")
        if not conf.actor_rollout_ref.rollout.calculate_log_probs:
            raise ConfigError(f"{loss_mode} needs actor_rollout_ref.rollout.calculate_log_probs=true")
