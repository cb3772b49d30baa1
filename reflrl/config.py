"""Typed run configuration: dataclasses, YAML files and dotted command-line overrides.

Every hyperparameter is declared once, below, with its default and a one-line help text
(``_f(default, "help")``); :func:`config_help` lists them all and :func:`save_config` writes
them as comments into a run folder's ``config.yaml``. Defaults are the code's defaults; the
default recipe lives in ``configs/default.yaml`` (:func:`default_recipe`, shipped in the package).

    cfg = load_config("configs/default.yaml", ["algo.clip_high=0.3", "env.faults=rate_limit=0.1"])
    save_config(cfg, run_dir / "config.yaml")      # reloads to an equal Config

Overrides are ``section.key=value`` (nested: ``env.retry.max_attempts=5``). Only the FIRST
``=`` separates key and value, so fault specs keep theirs. Values are parsed as YAML
(``3`` int, ``0.3`` float, ``true`` bool, ``null``, ``[a, b]`` list), except for string
fields, which take the text as it is (``model.name=1e-5`` is the string "1e-5"; ``null`` or
``~`` still mean None where None is allowed). A list-of-strings field also accepts
``a,b,c``.

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
key path, what was expected and what was given (with a did-you-mean for typos).

This module imports no torch when it is imported (the CLI imports it cheaply); validating a config
asks the registries of algorithms, samplers, variants, critics and engines for the names they know.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from .errors import ConfigError  # re-exported: raised by every layer, defined apart


def _f(default: Any, help: str) -> Any:  # noqa: A002 - "help" reads best at the declarations
    """A dataclass field with its help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


# ---------------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    """The policy model (see reflrl.models)."""

    name: str = _f("smollm2-135m-instruct", "registry name ('smollm2-135m-instruct', 'tiny-random'), HF id or local path")
    dtype: str = _f("auto", "weights/compute dtype on the CPU: 'auto' (bfloat16 only where the CPU computes it natively, else float32; reflrl.precision) | 'float32' | 'bfloat16'")
    trainable: str = _f("top_layers:6", "what trains: 'all' | 'none' | 'lora' | 'top_layers:K' (the top K decoder layers + head)")
    trainable_dtype: str | None = _f("float32", "dtype of the trainable parameters (float32 master weights); null = same as dtype")
    lora_r: int = _f(16, "LoRA rank (trainable='lora')")
    lora_alpha: int | None = _f(None, "LoRA alpha; null = 2 * lora_r")
    lora_dropout: float = _f(0.0, "LoRA dropout")
    init_from: str | None = _f(None, "start from a reflrl checkpoint folder (RUN/checkpoints/step_N): its trainable parameters, exact dtype, not its optimizer or step; model.name/trainable must match the run that wrote it (e.g. RL variants from one shared warm-up); null = the model as loaded")


@dataclass
class DataConfig:
    """Tasks to train and evaluate on (see reflrl.envs.datasets)."""

    source: str = _f("synthetic", "'synthetic' (generated tasks) or a loader name ('toolace', 'xlam', 'hammer', 'file')")
    path: str | None = _f(None, "local file for file-based sources (null for synthetic)")
    fmt: str | None = _f(None, "format of `path` ('jsonl', 'json', ...); null = guess from the file")
    n_train: int = _f(256, "number of training tasks")
    n_val: int = _f(32, "number of validation tasks (periodic evaluation; 0 = none)")
    n_test: int = _f(100, "number of held-out test tasks (accuracy before/after)")
    kinds: list[str] = _f(["single", "parallel"], "task kinds kept: single, parallel, multiple, multi_turn, ...")
    seed: int = _f(0, "seed of the dataset generator / shuffling (fixed so splits stay stable)")
    prompt_style: str = _f("compact", "how tools are listed in the system prompt: 'compact' (one line per tool) | 'json' (full schemas)")


@dataclass
class RetryConfig:
    """Client retry policy for tool calls hit by env faults (see reflrl.envs.client)."""

    max_attempts: int = _f(4, "attempts per tool call (1 = no retry); each attempt is billed as a call")
    budget_s: float = _f(30.0, "give up retrying a call after this many seconds in total")
    policy_max_attempts: int = _f(1, "attempts per tool call when env.fault_exposure='policy' (1 = every fault the tool gives reaches the policy; more = the client retries first)")


@dataclass
class EnvConfig:
    """The tool environment the policy acts in (see reflrl.envs.tool_env)."""

    id: str = _f("reflrl/ToolCall-v0", "gymnasium id: 'reflrl/ToolCall-v0' (single-turn) | 'reflrl/ToolCallMultiTurn-v0'")
    faults: str = _f("", "fault spec, e.g. 'rate_limit=0.1,timeout=0.05' ('' = no faults; --faults sets it)")
    fault_seed: int | None = _f(None, "seed of the fault stream; null = derived from the env seed")
    reward: str = _f("binary", "reward name in reflrl.envs.rewards: 'binary' (exact match, efficiency paper (arXiv:2606.00135) eq. 8) | 'fine' (DSCL) | ...")
    parser: str = _f("hermes", "tool-call parser: 'hermes' | 'pythonic' | 'react' | 'auto'")
    max_steps: int | None = _f(None, "assistant messages per episode before truncation; null = env default")
    retry: RetryConfig = _f(RetryConfig, "retry policy of the tool client")
    fault_exposure: str = _f("client", "who meets a fault the tool client does not absorb: 'client' (its retries; a fault they give up on masks the rollout, never penalised) | 'policy' (it comes back to the policy as the tool's answer - HTTP status, error code, message, Retry-After - and the episode goes on, so the policy may call again, call another tool or stop; a fault it could have acted on and did not is a wrong answer, one no action can handle stays masked: `reflrl faults list`; attempts per call: env.retry.policy_max_attempts)")
    turn_seconds: float = _f(2.0, "fault_exposure='policy': virtual seconds on the env's clock that each assistant message after the first costs (no wall time); a call made before a 429's Retry-After has passed is refused with 429 again")
    eval_fault_seed: int = _f(1234, "seed of the faults the held-out evaluations meet (env.faults): fixed, so every checkpoint of a run meets the same faults")
    concurrency: int = _f(8, "episodes stepped concurrently (1 = one at a time)")


@dataclass
class RolloutConfig:
    """Sampling of rollouts (see reflrl.rollout)."""

    n: int = _f(8, "rollouts per prompt (the GRPO group size)")
    batch_prompts: int = _f(8, "prompts per training step")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling threshold (1.0 = off)")
    max_new_tokens: int = _f(64, "new tokens per assistant turn at most (every task)")
    answer_cap: float | None = _f(None, "per-task token cap sized to the gold answer: ceil(answer_cap x the gold answer's tokens) + 16 (+ 128 with a <think> block), at most max_new_tokens; rollouts, reflection retries and evaluation alike; null = max_new_tokens for every task")
    stop_at_complete: bool = _f(True, "stop an answer as soon as it is complete: the end of the turn, or the end of its tool-call block(s) when other text follows (hermes format; reflrl.envs.parsing.answer_complete)")
    max_turns: int = _f(1, "assistant turns per episode (multi-turn envs)")
    max_total_tokens: int = _f(1024, "prompt + response token cap for multi-turn episodes")
    engine: str = _f("transformers", "who samples the RL rollouts: 'transformers' (the trained model itself, in process) | 'vllm' (vLLM offline engine on one GPU, weights pushed after every update: on-policy; needs the gpu extra) | 'openai' (an OpenAI-compatible server with its OWN weights, never synced: needs engine_off_policy=true; docs/scale-out.md)")
    engine_base_url: str | None = _f(None, "engine='openai': the server's base URL, e.g. http://127.0.0.1:8000/v1 (needs /v1/completions with token-id prompts, as vllm serve)")
    engine_model: str | None = _f(None, "engine='openai': the served model name; null = model.name")
    engine_off_policy: bool = _f(False, "engine='openai': accept that rollouts come from the server's frozen weights while the local model trains (off-policy after the first update, no importance correction)")


@dataclass
class AlgoConfig:
    """The RL algorithm (see reflrl.algos)."""

    advantage: str = _f("grpo", "advantage estimator: 'grpo' (efficiency paper, arXiv:2606.00135, eq. 2) | 'dr_grpo' | 'rloo' | 'gae' (PPO, needs a value head)")
    adv_eps: float = _f(1e-6, "epsilon added to the group std in GRPO")
    gamma: float = _f(1.0, "discount (GAE)")
    lam: float = _f(1.0, "GAE lambda")
    policy_loss: str = _f("clip_higher", "policy loss: 'clip_higher' | 'ppo_clip' (same function; set clip_high = clip_low for symmetric)")
    clip_low: float = _f(0.2, "epsilon_low of the ratio clip (efficiency paper, arXiv:2606.00135, appendix F: 0.2)")
    clip_high: float = _f(0.28, "epsilon_high of the ratio clip, clip-higher (efficiency paper, arXiv:2606.00135, appendix F: 0.28)")
    dual_clip_c: float | None = _f(None, "dual-clip constant c > 1 for negative advantages; null = off")
    loss_agg: str = _f("token-mean", "loss aggregation: 'token-mean' | 'seq-mean-token-mean' | 'seq-mean-token-sum' | 'seq-mean-token-sum-norm'")
    kl_coef: float = _f(0.0, "weight of the KL-to-reference loss (0 = no reference model, as the efficiency paper)")
    kl_estimator: str = _f("low_var_kl", "KL estimator: 'k1' | 'k2' | 'k3'/'low_var_kl' | 'abs' | 'mse'")
    entropy_coef: float = _f(0.0, "entropy bonus weight (0 = off, as the efficiency paper)")
    value_coef: float = _f(0.5, "critic loss weight (advantage='gae')")
    value_clip: float | None = _f(0.2, "critic value clip range (advantage='gae'); null = off")
    lr: float = _f(1e-5, "policy learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "max global grad norm (0 = no clipping)")
    epochs_per_batch: int = _f(1, "optimisation passes over each rollout batch (1 = on-policy)")
    micro_batch_size: int = _f(8, "sequences per forward/backward (gradient accumulation over the batch)")
    credit: str = _f("sequence", "which tokens a negative advantage applies to: 'sequence' (every token of the answer, GRPO as written) | 'call' (only the tool-call blocks that match no gold call, and the end of the turn when calls are missing; hermes single-turn answers, else every token: reflrl.train.credit)")
    self_distill: float = _f(0.0, "weight of self-distillation (SDPO, 'Reinforcement Learning via Self-Distillation', arXiv:2601.20802): every failed rollout is re-scored by the policy itself under a teacher prompt holding the critic's analysis of it (reflection.critic / reflection.reveal) and a correct answer of its group when there is one, and the policy on the original prompt is pulled toward that teacher (self_distill_mode), so all-wrong groups still give a signal; 0 = off (reflrl.train.distill). Measured on this repository's recipe (bfloat16, 3 seeds): every mode lowered held-out accuracy more than GRPO alone (README), so it is off")
    self_distill_mode: str = _f("topk", "how the self-teacher's predictions are distilled: 'topk' (forward KL(teacher || policy) on the teacher's top-k tokens at every action token of a failed rollout, plus a tail bucket: pulls the policy toward the tokens the teacher prefers, sampled or not) | 'sampled_token' (SDPO's default: the per-token advantage log pi_teacher - log pi on the sampled tokens only)")
    self_distill_topk: int = _f(20, "'topk' self-distillation: teacher tokens per position")
    self_distill_span: str = _f("all", "'topk' self-distillation: which action tokens of a failed rollout are distilled: 'all' | 'first_divergence' (up to and including the first token whose teacher top-1 differs from the sampled token, after which the teacher scores a prefix it already rejects; measured worse, README)")
    self_distill_teacher: str = _f("frozen", "whose weights the self-teacher uses: 'frozen' (the policy as RL started, or as a resumed run restarted: SDPO's 'base' teacher; a copy of the model in memory) | 'live' (the current policy: measured unstable here, the training reward fell from 0.81 to 0 in 8 steps on one seed)")
    self_distill_clip: float = _f(5.0, "'sampled_token' self-distillation: clamp of the per-token advantage (|teacher - student log-prob| at most this)")
    negative_weight: float = _f(1.0, "scale of the negative advantages after the group normalisation: 1 = GRPO as written; < 1 leans on the correct samples (positive sample reinforcement, which raises pass@1 fastest; 0 = only them), > 1 on the wrong ones (W-REINFORCE up-weights the negatives for pass@k): 'The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning', arXiv:2506.01347, sec. 3-4")
    downsample_m: int = _f(0, "max-variance down-sampling (efficiency paper, arXiv:2606.00135, sec. 4.2): train on m of n rollouts; 0 = off")
    prefilter_k: int = _f(0, "online pre-rollout filter (efficiency paper, arXiv:2606.00135, sec. 4.1): skip prompts all-correct for k epochs; 0 = off")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop zero-variance groups and refill the batch")
    max_refill_rounds: int = _f(3, "dynamic sampling: extra sampling rounds per step at most")


@dataclass
class SamplingConfig:
    """Prompt-level dynamic sampling and the DSCL curriculum (reflrl.algos.dscl)."""

    sampler: str = _f("none", "group filter after rollouts: 'none' | 'dapo' (drop zero-variance groups) | 'smv' (max variance) | 'smr' (mean reward band) | 'rds' (DSCL sec. 4.2)")
    warmup_gate: bool = _f(True, "the sampler acts only after the format stage converged (DSCL sec. 6.4, Table 3); false = from the first step")
    refill: bool = _f(False, "sample more prompts to refill the batch after filtering, as DAPO does (DSCL trains on the kept part only)")
    t_mean: float = _f(0.5, "RDS mean threshold t_mean (DSCL Table 4): M < t_mean is 'hard' (b)")
    t_var: float = _f(0.1, "RDS variance threshold t_var (DSCL Table 4) on V_current and V_history")
    unit_scale: bool = _f(False, "compare t_mean/t_var with rewards mapped to [0, 1] instead of the raw reward (DSCL appendix A.2 implies raw)")
    keep_a: float = _f(0.0, "RDS keep ratio of category a (easy, M = max; DSCL eq. 12: 0)")
    keep_b1: float = _f(1.0, "RDS keep ratio of category b.1 (hard, unstable; eq. 12: 1)")
    keep_b2: float = _f(0.0, "RDS keep ratio of category b.2 (hard, stable; eq. 12: 0)")
    keep_c1: float = _f(1.0, "RDS keep ratio of category c.1 (intermediate, unstable; eq. 12: 1)")
    keep_c2: float = _f(0.5, "RDS keep ratio of category c.2 (intermediate, stable; eq. 12: 0.5)")
    smv_keep: float = _f(0.5, "SMV: share of each batch's prompts kept, those of largest reward variance")
    smr_low: float = _f(0.25, "SMR: lowest mean reward (mapped to [0, 1]) of a kept prompt")
    smr_high: float = _f(0.75, "SMR: highest mean reward (mapped to [0, 1]) of a kept prompt")
    reset_history_on_stage: bool = _f(True, "forget the per-prompt reward history (V_history) when the curriculum stage changes")
    curriculum: bool = _f(False, "TDCL (DSCL sec. 4.1): weight the fine reward by stage (eq. 7); the stage is tracked anyway for warmup_gate")
    format_threshold: float = _f(0.9, "TDCL: windowed mean format reward that ends stage 1 (DSCL Table 4)")
    name_threshold: float = _f(0.75, "TDCL: windowed mean tool-name reward needed to end stage 2 (with key; Table 4)")
    key_threshold: float = _f(0.7, "TDCL: windowed mean parameter-key reward needed to end stage 2 (with name; Table 4)")
    window: int | None = _f(None, "TDCL: batches k in the convergence window (eq. 8); null = batches per epoch (paper: k = 7)")
    reset_window_on_stage: bool = _f(False, "TDCL: empty the window at a stage change, so the next gate needs k fresh batches")


@dataclass
class WarmupConfig:
    """Supervised warm-up on the training split's gold calls (reflrl.sft)."""

    enabled: Union[str, bool] = _f("auto", "'auto' (run when the format rate < threshold) | true | false")
    format_rate_threshold: float = _f(0.5, "auto: warm up when fewer than this share of probe samples parse")
    probe_n: int = _f(16, "tasks sampled (at the rollout temperature) to measure the format rate; 0 = use the greedy answers of the held-out evaluation before (no extra generation)")
    steps: int = _f(60, "SFT optimiser steps")
    lr: float = _f(5e-5, "SFT learning rate")
    batch_size: int = _f(8, "SFT examples per step")
    time_budget_min: float | None = _f(None, "guard: cut the warm-up after this many minutes (reported as a cut: the result is then not the recipe's); null = no limit")
    eval_after: bool = _f(True, "evaluate the held-out split right after the warm-up, so the summary tells the warm-up's gain from RL's (one more evaluation)")
    reflection_share: float = _f(0.0, "reflection practice: this share of the warm-up's examples (on top of the plain ones) are q* -> the gold call, q* holding a mistaken first attempt and the critic's analysis of it, so a small policy learns to act on a critique (reflrl.recovery.practice); 0 = off")


@dataclass
class TrainConfig:
    """The run: length, evaluation, checkpoints, logging."""

    steps: int = _f(40, "RL training steps")
    time_budget_min: float | None = _f(30.0, "guard on the whole run's minutes: a phase it would overrun (warm-up, RL) is cut, the final evaluation still runs, and the run says loudly that its result is not the recipe's (summary 'budget_cut', exit status 3); null = no limit")
    rl_minutes: float | None = _f(None, "equal-time stopping rule (scripts/paper_table.py --rl-minutes): start no RL step that would end after this many minutes of RL steps (by the last steps' mean), train.steps staying the ceiling; the steps done then depend on the machine's speed and load, and the summary and printed result say so (stop_reason 'rl_minutes'); null = off")
    eval_every: int = _f(0, "evaluate on the validation split every N steps (0 = only before/after)")
    save_every: int = _f(10, "checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept in the run folder (older ones are pruned)")
    log_every: int = _f(1, "write metrics every N steps")
    log_rollouts: bool = _f(False, "write every RL rollout to rollouts.jsonl in the run folder, one JSON line each (step, task id, group, response text, reward, correct, masked, advantage; a reflection repair also its retry prompt q* and the failed attempt), as verl's rollout_data_dir or TRL's log_completions")
    seed: int = _f(0, "seed of sampling, data order and model init")
    out_dir: str = _f("runs", "parent folder of run folders")
    run_name: str | None = _f(None, "run folder name; null = generated from time and seed")
    device: str = _f("auto", "where the model, rollouts, log-probs and update run: 'auto' (cuda when torch sees a CUDA device, else cpu) | 'cpu' | 'cuda' (the first CUDA device; model.dtype auto is bfloat16 there); reflrl.device")
    threads: int | None = _f(None, "torch CPU threads, fixed for the run; null = torch's default (one per core; the reflrl command makes waiting OpenMP threads sleep, so a busy machine slows a run down in proportion instead of collapsing: reflrl.threads)")


@dataclass
class ReflectionConfig:
    """Tool-ReRL's reflection-recovery loop and the paper's baselines (reflrl.recovery;
    Tool-ReRL sec. 3.2-3.3, Table 1, Table 2)."""

    variant: str = _f("grpo", "method by name (Tool-ReRL Table 1/2): 'grpo' (no reflection) | 'ppo' (needs a value head: verl backend only) | 'cot' (thought then call) | 'ref' (repaired trajectories trained as on-policy, no correction) | 'cot_is' (own thought in q*, importance-weighted) | 'external' / 'external_is' (reasoning from the critic endpoint, without / with the weight) | 'tool_rerl' (critic reflection + eq. 2) | 'dpo' (DPO on failure/repair pairs)")
    critic: str = _f("rule", "frozen critic for 'ref', 'tool_rerl', 'dpo': 'rule' (embedded, no model) | 'llm' (critic_base_url) | 'policy' (the policy itself)")
    critic_base_url: str | None = _f(None, "OpenAI-compatible endpoint of the 'llm' critic and the 'external*' variants, e.g. http://127.0.0.1:8000/v1 (python -m reflrl.chat_server)")
    critic_model: str = _f("default", "model name the critic endpoint serves")
    critic_timeout_s: float = _f(60.0, "per-request timeout of the critic endpoint (seconds)")
    reveal: str = _f("query", "rule critic: how much of an expected value the analysis gives away: 'none' | 'query' (the request's span that holds it) | 'value' (the expected values) | 'call' (value + the whole expected answer) | 'answer' (the same, written in the policy's answer format)")
    max_attempts: int = _f(2, "retries sampled under q* per failed trajectory, stopping at the first positive (Definition 1 ii)")
    max_per_step: int = _f(0, "at most this many failed trajectories reflected on per step (env faults first); 0 = all")
    reflect_on: str = _f("failure", "which failures are reflected on: 'failure' (env faults and policy errors) | 'env_fault' (only env faults)")
    mode: str = _f("replace", "how q* is rendered: 'replace' (the user message becomes appendix C's retry prompt) | 'append' (attempt + retry prompt appended)")
    group: str = _f("replace", "how a repair enters its GRPO group: 'replace' (tau* takes the failed rollout's place, as the paper's transformed trajectory) | 'add' (tau* joins the group beside the failure, which keeps its negative advantage)")
    think: bool | None = _f(None, "ask for a <think> block before the calls; null = the variant's default (true for cot and cot_is)")
    train_on_qstar: bool = _f(False, "also train each repair under its retry prompt q* (on-policy there, with the repair's advantage), beside the repair on q with eq. 2's weight: the paper trains on q only; for a small policy this keeps it acting on critiques during RL (reflrl.recovery.qstar_trajectory)")
    level: str = _f("sequence", "importance ratio level (reflrl.algos.importance): 'sequence' (eq. 2) | 'token' | 'sequence_mean'")
    log_cap: float = _f(5.0, "clamp of the repaired trajectories' log importance ratio (weights within [e^-cap, e^cap])")
    dpo_beta: float = _f(0.1, "'dpo': beta of the DPO loss on (repaired, failed) pairs")


@dataclass
class Config:
    """A whole run's configuration."""

    model: ModelConfig = _f(ModelConfig, "policy model")
    data: DataConfig = _f(DataConfig, "tasks")
    env: EnvConfig = _f(EnvConfig, "tool environment")
    rollout: RolloutConfig = _f(RolloutConfig, "rollout sampling")
    algo: AlgoConfig = _f(AlgoConfig, "RL algorithm")
    sampling: SamplingConfig = _f(SamplingConfig, "dynamic sampling and curriculum")
    warmup: WarmupConfig = _f(WarmupConfig, "supervised warm-up")
    train: TrainConfig = _f(TrainConfig, "run control")
    reflection: ReflectionConfig = _f(ReflectionConfig, "reflection-recovery (Tool-ReRL) and its baselines")


# ---------------------------------------------------------------------------------- choices
DTYPES = ("float32", "bfloat16")
MODEL_DTYPES = ("auto", *DTYPES)  # reflrl.precision.DTYPE_NAMES
PARSERS = ("hermes", "pythonic", "react", "auto")
PROMPT_STYLES = ("compact", "json")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


# ---------------------------------------------------------------------------------- type checks
_NUMBER_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> bool:
    return type(None) in _union_args(tp)


def _union_args(tp: Any) -> tuple:
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return typing.get_args(tp)
    return (tp,)


def _type_name(tp: Any) -> str:
    args = _union_args(tp)
    if len(args) > 1:
        return " or ".join(_type_name(a) for a in args)
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "null"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against type ``tp`` (int -> float is allowed); return the value to store."""
    for arg in _union_args(tp):
        if arg is type(None):
            if value is None:
                return None
            continue
        if arg is bool:
            if isinstance(value, bool):
                return value
        elif arg is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif arg is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str) and _NUMBER_RE.match(value.strip()):
                return float(value)  # PyYAML reads 1e-5 (no dot) as a string
        elif arg is str:
            if isinstance(value, str):
                return value
        elif typing.get_origin(arg) is list:
            (item_tp,) = typing.get_args(arg)
            if isinstance(value, str) and item_tp is str:
                return [s.strip() for s in value.split(",") if s.strip()]
            if isinstance(value, (list, tuple)):
                return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        elif dataclasses.is_dataclass(arg):
            return _build(arg, value, where)
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")


def _unknown_key(key: str, where: str, allowed: list[str]) -> ConfigError:
    path = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    scope = f"in {where!r}" if where else "at the top level"
    return ConfigError(f"unknown key {path!r}{hint}; allowed keys {scope}: {', '.join(allowed)}")


def _build(cls: type, data: Any, where: str) -> Any:
    """Dataclass ``cls`` from a (partial) mapping; missing keys keep their defaults."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {_show(data)}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in names:
            raise _unknown_key(str(key), where, names)
        path = f"{where}.{key}" if where else key
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------- validation
def _choice(errors: list[str], path: str, value: Any, choices: tuple | list) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        errors.append(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}{hint}")


def registered(kind: str) -> list[str]:
    """The names a registry knows (``reflrl.registry.Registry``), so names registered by a plugin are
    accepted too; ``reveal``: the rule critic's disclosure levels, from the module that implements them. Imported when a config is validated, not when this module is (no torch at import)."""
    if kind in ("advantage", "policy_loss"):
        from reflrl.algos.registry import ADVANTAGES, POLICY_LOSSES

        return (ADVANTAGES if kind == "advantage" else POLICY_LOSSES).names()
    if kind == "sampler":
        from reflrl.algos.dscl.samplers import SAMPLERS_REGISTRY

        return SAMPLERS_REGISTRY.names()
    if kind == "variant":
        from reflrl.recovery.variants import VARIANTS

        return VARIANTS.names()
    if kind == "critic":
        from reflrl.recovery.critics import CRITICS

        return CRITICS.names()
    if kind == "engine":
        from reflrl.engines import ENGINES

        return ENGINES.names()
    if kind == "reveal":  # the rule critic's disclosure levels, defined where they are implemented
        from reflrl.critic.rule import REVEAL_MODES

        return list(REVEAL_MODES)
    raise ValueError(f"no registry of {kind!r}")


def validate(cfg: Config) -> Config:
    """Check value ranges and choices across the config; raise one ConfigError listing all problems."""
    e: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            e.append(msg)

    m = cfg.model
    _choice(e, "model.dtype", m.dtype, MODEL_DTYPES)
    if m.trainable_dtype is not None:
        _choice(e, "model.trainable_dtype", m.trainable_dtype, DTYPES)
    t = m.trainable
    if t not in ("all", "none", "lora"):
        k = t.split(":", 1)[1] if t.startswith("top_layers:") else ""
        need(k.isdigit() and int(k) >= 1,
             f"model.trainable: {t!r} is not 'all', 'none', 'lora' or 'top_layers:K' with K >= 1")
    need(m.lora_r >= 1, f"model.lora_r: must be >= 1, got {m.lora_r}")
    need(0.0 <= m.lora_dropout < 1.0, f"model.lora_dropout: must be in [0, 1), got {m.lora_dropout}")

    d = cfg.data
    for name in ("n_train", "n_val", "n_test"):
        need(getattr(d, name) >= 0, f"data.{name}: must be >= 0, got {getattr(d, name)}")
    need(d.n_train >= 1, f"data.n_train: must be >= 1, got {d.n_train}")
    need(bool(d.kinds), "data.kinds: must list at least one task kind")
    _choice(e, "data.prompt_style", d.prompt_style, PROMPT_STYLES)

    v = cfg.env
    _choice(e, "env.parser", v.parser, PARSERS)
    need(v.max_steps is None or v.max_steps >= 1, f"env.max_steps: must be >= 1 or null, got {v.max_steps}")
    need(v.retry.max_attempts >= 1, f"env.retry.max_attempts: must be >= 1, got {v.retry.max_attempts}")
    need(v.retry.policy_max_attempts >= 1, f"env.retry.policy_max_attempts: must be >= 1, got {v.retry.policy_max_attempts}")
    _choice(e, "env.fault_exposure", v.fault_exposure, ("client", "policy"))
    need(v.turn_seconds >= 0, f"env.turn_seconds: must be >= 0, got {v.turn_seconds}")
    need(v.retry.budget_s > 0, f"env.retry.budget_s: must be > 0, got {v.retry.budget_s}")
    need(v.concurrency >= 1, f"env.concurrency: must be >= 1, got {v.concurrency}")

    r = cfg.rollout
    need(r.n >= 1, f"rollout.n: must be >= 1, got {r.n}")
    need(r.batch_prompts >= 1, f"rollout.batch_prompts: must be >= 1, got {r.batch_prompts}")
    need(r.temperature > 0, f"rollout.temperature: must be > 0, got {r.temperature}")
    need(0 < r.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    need(r.max_new_tokens >= 1, f"rollout.max_new_tokens: must be >= 1, got {r.max_new_tokens}")
    need(r.max_turns >= 1, f"rollout.max_turns: must be >= 1, got {r.max_turns}")
    need(r.answer_cap is None or r.answer_cap >= 1.0,
         f"rollout.answer_cap: must be >= 1 (a multiple of the gold answer's length) or null, got {r.answer_cap}")
    _choice(e, "rollout.engine", r.engine, registered("engine"))
    if r.engine == "openai":
        need(bool(r.engine_base_url), "rollout.engine_base_url: rollout.engine='openai' needs the server's URL, "
             "e.g. http://127.0.0.1:8000/v1")
        need(r.engine_off_policy, "rollout.engine='openai': the server samples from its own weights and the "
             "trainer cannot sync the updated policy to it (an OpenAI-compatible API has no weight upload), so "
             "every rollout after the first update is off-policy and uncorrected; set "
             "rollout.engine_off_policy=true to train that way anyway, or use rollout.engine='transformers' "
             "or rollout.engine='vllm' (on-policy, weights pushed after every update; GPU))")
    need(r.max_total_tokens >= r.max_new_tokens,
         f"rollout.max_total_tokens: must be >= rollout.max_new_tokens ({r.max_new_tokens}), got {r.max_total_tokens}")

    a = cfg.algo
    _choice(e, "algo.advantage", a.advantage, registered("advantage"))
    _choice(e, "algo.policy_loss", a.policy_loss, registered("policy_loss"))
    _choice(e, "algo.loss_agg", a.loss_agg, LOSS_AGG_MODES)
    _choice(e, "algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _choice(e, "algo.credit", a.credit, ("sequence", "call"))
    _choice(e, "algo.self_distill_mode", a.self_distill_mode, ("topk", "sampled_token"))
    _choice(e, "algo.self_distill_teacher", a.self_distill_teacher, ("frozen", "live"))
    need(a.self_distill == 0 or cfg.reflection.variant != "dpo",
         f"algo.self_distill={a.self_distill}: the 'dpo' variant trains DPO pairs only; self-distillation needs a policy-gradient variant")
    _choice(e, "algo.self_distill_span", a.self_distill_span, ("first_divergence", "all"))
    need(a.self_distill_topk >= 1, f"algo.self_distill_topk: must be >= 1, got {a.self_distill_topk}")
    need(0 <= a.clip_low < 1, f"algo.clip_low: must be in [0, 1), got {a.clip_low}")
    need(a.clip_high >= 0, f"algo.clip_high: must be >= 0, got {a.clip_high}")
    need(a.dual_clip_c is None or a.dual_clip_c > 1, f"algo.dual_clip_c: must be > 1 or null, got {a.dual_clip_c}")
    need(0 <= a.gamma <= 1, f"algo.gamma: must be in [0, 1], got {a.gamma}")
    need(0 <= a.lam <= 1, f"algo.lam: must be in [0, 1], got {a.lam}")
    for name in ("kl_coef", "entropy_coef", "value_coef", "weight_decay", "grad_clip", "adv_eps", "negative_weight",
                 "self_distill"):
        need(getattr(a, name) >= 0, f"algo.{name}: must be >= 0, got {getattr(a, name)}")
    need(a.self_distill_clip > 0, f"algo.self_distill_clip: must be > 0, got {a.self_distill_clip}")
    need(a.lr > 0, f"algo.lr: must be > 0, got {a.lr}")
    need(a.epochs_per_batch >= 1, f"algo.epochs_per_batch: must be >= 1, got {a.epochs_per_batch}")
    need(a.micro_batch_size >= 1, f"algo.micro_batch_size: must be >= 1, got {a.micro_batch_size}")
    need(a.downsample_m == 0 or 2 <= a.downsample_m < r.n,
         f"algo.downsample_m: must be 0 (off) or in 2..rollout.n-1 = {r.n - 1}, got {a.downsample_m}")
    need(a.prefilter_k >= 0, f"algo.prefilter_k: must be >= 0 (0 = off), got {a.prefilter_k}")
    need(a.max_refill_rounds >= 0, f"algo.max_refill_rounds: must be >= 0, got {a.max_refill_rounds}")
    need(a.value_clip is None or a.value_clip > 0, f"algo.value_clip: must be > 0 or null, got {a.value_clip}")

    s = cfg.sampling
    _choice(e, "sampling.sampler", s.sampler, registered("sampler"))
    for name in ("keep_a", "keep_b1", "keep_b2", "keep_c1", "keep_c2",
                 "format_threshold", "name_threshold", "key_threshold"):
        need(0 <= getattr(s, name) <= 1, f"sampling.{name}: must be in [0, 1], got {getattr(s, name)}")
    need(s.t_var >= 0, f"sampling.t_var: must be >= 0, got {s.t_var}")
    need(0 < s.smv_keep <= 1, f"sampling.smv_keep: must be in (0, 1], got {s.smv_keep}")
    need(0 <= s.smr_low <= s.smr_high <= 1,
         f"sampling.smr_low/smr_high: need 0 <= smr_low <= smr_high <= 1, got {s.smr_low}, {s.smr_high}")
    need(s.window is None or s.window >= 1, f"sampling.window: must be >= 1 or null, got {s.window}")
    need(not (a.dynamic_sampling and s.sampler not in ("none", "dapo")),
         f"algo.dynamic_sampling (DAPO) and sampling.sampler={s.sampler!r} both filter groups; use one")
    need(not s.curriculum or v.reward.startswith("fine"),
         f"sampling.curriculum: needs a fine-grained reward (env.reward='fine'), got env.reward={v.reward!r}")

    if cfg.model.init_from is not None:
        ck = Path(str(cfg.model.init_from)).expanduser()
        need((ck / "trainable.pt").is_file(),
             f"model.init_from: {cfg.model.init_from} is not a reflrl checkpoint folder (no trainable.pt; "
             "expected RUN/checkpoints/step_N)")
    w = cfg.warmup
    need(w.enabled in ("auto", True, False), f"warmup.enabled: expected 'auto', true or false, got {_show(w.enabled)}")
    need(0 <= w.format_rate_threshold <= 1,
         f"warmup.format_rate_threshold: must be in [0, 1], got {w.format_rate_threshold}")
    for name in ("steps", "probe_n"):
        need(getattr(w, name) >= 0, f"warmup.{name}: must be >= 0, got {getattr(w, name)}")
    need(w.batch_size >= 1, f"warmup.batch_size: must be >= 1, got {w.batch_size}")
    need(w.lr > 0, f"warmup.lr: must be > 0, got {w.lr}")

    tr = cfg.train
    for name in ("steps", "eval_every", "save_every"):
        need(getattr(tr, name) >= 0, f"train.{name}: must be >= 0, got {getattr(tr, name)}")
    need(tr.log_every >= 1, f"train.log_every: must be >= 1, got {tr.log_every}")
    need(tr.keep_checkpoints >= 1, f"train.keep_checkpoints: must be >= 1, got {tr.keep_checkpoints}")
    need(0.0 <= cfg.warmup.reflection_share <= 1.0,
         f"warmup.reflection_share: must be in [0, 1], got {cfg.warmup.reflection_share}")
    need(tr.rl_minutes is None or tr.rl_minutes > 0, f"train.rl_minutes: must be > 0 or null, got {tr.rl_minutes}")
    need(tr.time_budget_min is None or tr.time_budget_min > 0,
         f"train.time_budget_min: must be > 0 or null, got {tr.time_budget_min}")
    need(tr.threads is None or tr.threads >= 1, f"train.threads: must be >= 1 or null, got {tr.threads}")
    _choice(e, "train.device", tr.device, ("auto", "cpu", "cuda"))
    if tr.run_name is not None:
        need(tr.run_name not in ("", ".", "..") and "/" not in tr.run_name and "\\" not in tr.run_name,
             f"train.run_name: must be a plain folder name, got {tr.run_name!r}")

    f = cfg.reflection
    _choice(e, "reflection.variant", f.variant, registered("variant"))
    _choice(e, "reflection.critic", f.critic, registered("critic"))
    _choice(e, "reflection.reveal", f.reveal, registered("reveal"))
    _choice(e, "reflection.reflect_on", f.reflect_on, ("failure", "env_fault"))
    _choice(e, "reflection.mode", f.mode, ("replace", "append"))
    _choice(e, "reflection.group", f.group, ("replace", "add"))
    _choice(e, "reflection.level", f.level, ("sequence", "token", "sequence_mean"))
    need(f.max_attempts >= 1, f"reflection.max_attempts: must be >= 1, got {f.max_attempts}")
    need(f.max_per_step >= 0, f"reflection.max_per_step: must be >= 0 (0 = all), got {f.max_per_step}")
    need(f.log_cap > 0, f"reflection.log_cap: must be > 0, got {f.log_cap}")
    need(f.dpo_beta > 0, f"reflection.dpo_beta: must be > 0, got {f.dpo_beta}")
    need(f.critic_timeout_s > 0, f"reflection.critic_timeout_s: must be > 0, got {f.critic_timeout_s}")
    reflects = f.variant in ("ref", "cot_is", "external", "external_is", "tool_rerl", "dpo")
    need(not reflects or r.max_turns == 1,
         f"reflection.variant={f.variant!r} repairs single-step tasks (the paper's ToolACE setting); "
         f"got rollout.max_turns={r.max_turns}")
    need(not (f.variant.startswith("external") or (reflects and f.critic == "llm")) or bool(f.critic_base_url),
         f"reflection.variant={f.variant!r} with an LLM critic needs reflection.critic_base_url (an "
         f"OpenAI-compatible endpoint, e.g. `python -m reflrl.chat_server --model NAME --port 8000` -> "
         f"http://127.0.0.1:8000/v1)")

    if e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(e))
    return cfg


# ---------------------------------------------------------------------------------- overrides
def _field_type(path: list[str]) -> Any:
    """Type of the field at dotted ``path`` (raises ConfigError for unknown keys)."""
    cls: Any = Config
    for i, key in enumerate(path):
        names = [f.name for f in dataclasses.fields(cls)]
        if key not in names:
            raise _unknown_key(key, ".".join(path[:i]), names)
        tp = _hints(cls)[key]
        if i == len(path) - 1:
            return tp
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            raise ConfigError(f"{'.'.join(path[: i + 1])} is a value, not a section: cannot set {'.'.join(path)!r}")
        cls = tp
    return cls


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"algo.clip_high=0.3"`` -> (["algo", "clip_high"], 0.3). Splits on the FIRST '='."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. algo.clip_high=0.3")
    key, raw = text.split("=", 1)
    key = key.strip()
    path = key.split(".")
    if not key or any(not p for p in path):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    tp = _field_type(path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        value = _yaml_value(raw, text)
        return path, value
    args = _union_args(tp)
    if str in args:  # string fields take the text verbatim (fault specs, names, paths)
        if _is_optional(tp) and raw.strip() in ("null", "~", "Null", "NULL"):
            return path, None
        if int in args and re.fullmatch(r"[-+]?\d+", raw.strip()):  # e.g. train.threads=2 (or 'auto')
            return path, int(raw)
        if args == (str,) or raw.strip() not in ("true", "false", "True", "False"):
            return path, raw
    return path, _yaml_value(raw, text)


def _yaml_value(raw: str, text: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: cannot parse value {raw!r}: {exc}") from None


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[path[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---------------------------------------------------------------------------------- public API
def recipes_dir() -> Path:
    """The folder of the shipped YAML recipes: ``configs/`` of a checkout (editable install) or
    ``reflrl/configs/`` of an installed wheel, found the same way in both (package data of
    ``reflrl.configs``), so ``reflrl train`` runs the same default recipe wherever it is installed."""
    from importlib.resources import files

    return Path(str(files("reflrl.configs")))


def default_recipe() -> Path:
    """``default.yaml``: the recipe ``reflrl train`` runs when no ``--config`` is given."""
    return recipes_dir() / "default.yaml"


def config_from_dict(data: dict | None) -> Config:
    """Config from a nested mapping (missing keys take defaults), type-checked and validated."""
    return validate(_build(Config, data or {}, ""))


def _read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The mapping of a YAML config file, with its ``base:`` chain merged under it.

    A top-level ``base: FILE`` (relative to the file's folder) makes the file a partial recipe on top
    of FILE (e.g. ``configs/dscl.yaml`` has ``base: default.yaml``): FILE's keys first, this
    file's keys over them, key by key. Without ``base`` missing keys take the code defaults.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"config file {str(p)!r}: 'base' chain loops back to itself")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(p, exc)) from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping of sections, got {_show(loaded)}")
    data = dict(loaded or {})
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config file {str(p)!r}: 'base' must be a file name, got {_show(base)}")
    return _merge(_read_config_file(p.parent / base, _seen + (p.resolve(),)), data)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line naming the file, line and column (1-based) and what YAML found wrong there."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    ctx, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if ctx and cmark is not None and mark is not None and cmark.line != mark.line:
        problem += f" ({ctx}, which starts at line {cmark.line + 1}, column {cmark.column + 1})"
    return f"{where}: not valid YAML: {problem}"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (None = defaults), apply dotted overrides, check types and values.

    A file may start from another with a top-level ``base: FILE`` key (see :func:`_read_config_file`).

    Raises ConfigError for a missing/invalid file, unknown keys, wrong types or bad values.
    """
    data = _read_config_file(path) if path is not None else {}
    # Check the file alone first so its errors are not blamed on an override.
    _build(Config, data, "")
    ov: dict = {}
    for text in overrides:
        key_path, value = parse_override(text)
        _set_path(ov, key_path, value)
    return config_from_dict(_merge(data, ov))


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict of ``cfg`` (YAML/JSON-safe)."""
    return dataclasses.asdict(cfg)


def config_diff(cfg: Config, base: Config | None = None) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ from ``base`` (default: the code defaults) -> (base, cfg)."""
    out: dict[str, tuple[Any, Any]] = {}

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict):
            for k in a:
                walk(a[k], b[k], f"{prefix}.{k}" if prefix else k)
        elif a != b:
            out[prefix] = (a, b)

    walk(config_to_dict(base or Config()), config_to_dict(cfg), "")
    return out


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").strip()


def dump_config(cfg: Config, header: str | None = None) -> str:
    """YAML text of ``cfg`` with each key's help text as a comment; loads back to ``cfg``."""
    lines = [f"# {h}" for h in header.splitlines()] if header else []

    def section(obj: Any, indent: int) -> None:
        pad = "  " * indent
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            help_text = f.metadata.get("help", "")
            if dataclasses.is_dataclass(value):
                if indent == 0 and lines:
                    lines.append("")
                lines.append(f"{pad}{f.name}:  # {help_text}" if help_text else f"{pad}{f.name}:")
                section(value, indent + 1)
            else:
                lines.append(f"{pad}{f.name}: {_yaml_scalar(value)}" + (f"  # {help_text}" if help_text else ""))

    section(cfg, 0)
    return "\n".join(lines) + "\n"


def save_config(cfg: Config, path: str | Path, header: str | None = None) -> Path:
    """Write ``cfg`` as commented YAML to ``path`` (e.g. a run folder's config.yaml)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump_config(cfg, header), encoding="utf-8")
    return p


def config_help() -> str:
    """Every key with its type, default and help text, one per line (for ``--help-config``)."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, key + ".")
            else:
                out.append(f"{key} ({_type_name(tp)}, default {_yaml_scalar(getattr(default, f.name))}): "
                           f"{f.metadata.get('help', '')}")

    walk(Config, "")
    return "\n".join(out)
