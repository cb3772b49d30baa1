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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import reflrl.algos  # noqa: F401  (registers "tool_rerl", so reflrl.config.validate accepts it)
from reflrl.config import Config, ConfigError, config_from_dict, validate

from . import require_verl

REWARD_FILE = str(Path(__file__).with_name("reward.py"))

POLICY_LOSS_MAP = {"clip_higher": "vanilla", "ppo_clip": "vanilla", "tool_rerl": "reflrl_tool_rerl"}
ADVANTAGE_MAP = {"grpo": "reflrl_grpo", "dr_grpo": "reflrl_dr_grpo", "rloo": "rloo", "gae": "gae"}
DUAL_CLIP_OFF = 1.0e9


@dataclass
class VerlSettings:
    """Scale-out settings of a verl run (the ``verl:`` section of a recipe)."""

    n_gpus_per_node: int = 8
    nnodes: int = 1
    ppo_mini_batch_size: int = 256
    micro_batch_size_per_gpu: int = 4
    log_prob_micro_batch_size_per_gpu: int = 8
    max_prompt_length: int = 2048
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    rollout_engine: str = "vllm"
    model_dtype: str = "bfloat16"
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
            if not isinstance(getattr(s, k), int) or getattr(s, k) < 1:
                raise ConfigError(f"verl.{k}: must be an integer >= 1, got {getattr(s, k)!r}")
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
    tree = dict(raw.get("reflrl") or {})
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
    return Recipe(cfg, settings)


def rollout_correction_for(loss_mode: str):
    """verl's ``algorithm.rollout_correction`` for a loss mode: for our ``reflrl_tool_rerl*`` losses
    token-level, untruncated IS weights (the behaviour log-prob carrier); None otherwise."""
    require_verl()
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    from .losses import LOSS_LEVELS, UNTRUNCATED_THRESHOLD

    if loss_mode not in LOSS_LEVELS:
        return None
    return RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=UNTRUNCATED_THRESHOLD,
                                   rollout_is_batch_normalize=False, rollout_rs=None, bypass_mode=False)


def verl_keys(cfg: Config, s: VerlSettings) -> dict[str, Any]:
    """The dotted verl keys our settings set (before the raw overrides)."""
    a, r = cfg.algo, cfg.rollout
    if a.policy_loss not in POLICY_LOSS_MAP:
        raise ConfigError(f"algo.policy_loss={a.policy_loss!r} has no verl counterpart; use one of "
                          f"{sorted(POLICY_LOSS_MAP)}")
    if a.advantage not in ADVANTAGE_MAP:
        raise ConfigError(f"algo.advantage={a.advantage!r} has no verl counterpart; use one of {sorted(ADVANTAGE_MAP)}")
    loss_mode = POLICY_LOSS_MAP[a.policy_loss]
    rf = getattr(cfg, "reflection", None)
    # CPU-trainer options verl has no counterpart for: refused rather than silently dropped
    if float(a.negative_weight) != 1.0:
        raise ConfigError(f"algo.negative_weight={a.negative_weight}: the verl backend trains with GRPO's advantages "
                          "as computed (1.0); negative_weight is a CPU-trainer option")
    if a.self_distill > 0:
        raise ConfigError(f"algo.self_distill={a.self_distill}: self-distillation re-scores rollouts under the critic's "
                          "teacher prompt in the CPU trainer (reflrl.train.distill); the verl backend has no such step")
    if a.credit != "sequence":
        raise ConfigError(f"algo.credit={a.credit}: the verl backend gives every token its sequence advantage "
                          "('sequence'); per-call credit is a CPU-trainer option")
    if cfg.env.fault_exposure != "client":
        # env.turn_seconds and env.retry.policy_max_attempts only act with 'policy'; env.eval_fault_seed
        # seeds the CPU trainer's held-out evaluation (verl validates on its own val files): not needed
        raise ConfigError(f"env.fault_exposure={cfg.env.fault_exposure!r}: the verl agent loop lets the tool client "
                          "retry and masks what it gives up on ('client'); faults the policy sees are a CPU-trainer "
                          "option")
    if cfg.train.log_rollouts:
        raise ConfigError("train.log_rollouts=true: on the verl backend use verl's own rollout dump, the verl "
                          "override trainer.rollout_data_dir=DIR")
    if rf is not None and rf.train_on_qstar:
        raise ConfigError("reflection.train_on_qstar=true: the verl backend trains repairs on q only; "
                          "train_on_qstar is a CPU-trainer option")
    if loss_mode == "reflrl_tool_rerl" and rf is not None:
        # the ratio level and log cap of eq. 2, as the CPU trainer applies them (reflection.level / log_cap)
        from reflrl.algos.importance import DEFAULT_LOG_CAP

        from .losses import LOSS_LEVELS

        by_level = {lv: name for name, lv in LOSS_LEVELS.items()}
        if rf.level not in by_level:
            raise ConfigError(f"reflection.level={rf.level!r} has no verl loss; use one of {sorted(by_level)}")
        loss_mode = by_level[rf.level]
        if float(rf.log_cap) != DEFAULT_LOG_CAP:
            raise ConfigError(f"reflection.log_cap={rf.log_cap}: the verl losses are registered with log_cap "
                              f"{DEFAULT_LOG_CAP} (reflrl.verl_backend.losses.register_losses); other caps are "
                              "not supported on the verl backend")
    arr, act = "actor_rollout_ref.", "actor_rollout_ref.actor."
    k: dict[str, Any] = {
        "data.train_files": s.train_files,
        "data.val_files": s.val_files,
        "data.train_batch_size": r.batch_prompts,
        "data.max_prompt_length": s.max_prompt_length,
        "data.max_response_length": r.max_new_tokens,
        "data.seed": cfg.data.seed,
        "data.return_raw_chat": True,
        arr + "model.path": cfg.model.name,
        act + "strategy": "fsdp",
        act + "ppo_mini_batch_size": s.ppo_mini_batch_size,
        act + "ppo_micro_batch_size_per_gpu": s.micro_batch_size_per_gpu,
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
        "trainer.default_local_dir": str(Path(cfg.train.out_dir) / (cfg.train.run_name or s.experiment_name)),
    }
    if a.advantage == "gae":
        k.update({
            "critic.optim.lr": s.critic_lr,
            "critic.cliprange_value": a.value_clip if a.value_clip is not None else 1.0e9,
            "critic.ppo_micro_batch_size_per_gpu": s.micro_batch_size_per_gpu,
            "critic.ppo_mini_batch_size": s.ppo_mini_batch_size,
            "critic.model.path": cfg.model.name,
        })
    rc = rollout_correction_for(loss_mode)
    if rc is not None:
        for f in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "bypass_mode"):
            k[f"algorithm.rollout_correction.{f}"] = getattr(rc, f)
    return k


def episode_defaults(cfg: Config, s: VerlSettings) -> dict[str, Any]:
    """The top-level ``reflrl`` section of the verl config: the agent loop's episode defaults."""
    d = {"faults": cfg.env.faults, "fault_seed": int(cfg.env.fault_seed or 0), "seed": cfg.train.seed,
         "reward": cfg.env.reward, "parser": cfg.env.parser, "prompt_style": cfg.data.prompt_style,
         "retry_max_attempts": cfg.env.retry.max_attempts, "retry_budget_s": cfg.env.retry.budget_s}
    d.update(dict(s.reflection))
    from .episode import EpisodeSettings

    try:
        EpisodeSettings.from_sources(d)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"verl.reflection: {e}") from None
    return d


def _compose_default():
    verl = require_verl()
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    cdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cdir, version_base=None):
        return compose(config_name="ppo_trainer")


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
        raise ConfigError(f"verl config has no key {key!r} (verl {require_verl().__version__}); "
                          "prefix it with '+' to add a new key") from None


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
    loss's requirements."""
    require_verl()
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(config=conf, use_reference_policy=need_reference_policy(conf), use_critic=need_critic(conf))
    omega_conf_to_dataclass(conf.algorithm)
    omega_conf_to_dataclass(conf.actor_rollout_ref.rollout)
    loss_mode = conf.actor_rollout_ref.actor.policy_loss.loss_mode
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
