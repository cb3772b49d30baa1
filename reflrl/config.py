"""Typed run configuration: dataclasses, YAML files and dotted command-line overrides.

Every hyperparameter is declared once, below, with its default and a one-line help text
(``_f(default, "help")``); :func:`config_help` lists them all and :func:`save_config` writes
them as comments into a run folder's ``config.yaml``. The defaults declared here ARE the default
recipe (what ``reflrl train`` runs with no arguments, ``load_config(None)``); every YAML recipe in
``configs/`` is an overlay that lists only the keys it changes (``configs/default.yaml`` changes none).

    cfg = load_config(None, ["algo.clip_high=0.3", "env.faults=rate_limit=0.1"])
    save_config(cfg, run_dir / "config.yaml")      # reloads to an equal Config

Overrides are ``section.key=value`` (nested: ``env.retry.max_attempts=5``). Only the FIRST
``=`` separates key and value, so fault specs keep theirs. Values are parsed as YAML
(``3`` int, ``0.3`` float, ``true`` bool, ``null``, ``[a, b]`` list), except for string
fields, which take the text as it is (``model.name=1e-5`` is the string "1e-5"; ``null`` or
``~`` still mean None where None is allowed). A list-of-strings field also accepts
``a,b,c``.

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
key path, what was expected and what was given (with a did-you-mean for typos).

This module imports no torch when it is imported (the CLI imports it cheaply). Validation is a set of
small named checks per section (:func:`validate`, :func:`check_trainer`); names are checked against the
registries that hold them (:data:`reflrl.registry.DIRECTORY`), so this module imports none of the
modules that implement them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Union

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
    dtype: str = _f("auto", "weights/compute dtype on the CPU: 'auto' (the faster of bfloat16 and float32 on this CPU, measured once per CPU model; float32 where bfloat16 is emulated; reflrl.precision) | 'float32' | 'bfloat16'")
    trainable: str = _f("top_layers:12", "what trains: 'all' | 'none' | 'lora' | 'top_layers:K' (the top K decoder layers + head)")
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
    n_train: int = _f(512, "number of training tasks")
    n_val: int = _f(16, "number of validation tasks (periodic evaluation; 0 = none)")
    n_test: int = _f(48, "number of held-out test tasks (accuracy before/after)")
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
    faults: str = _f("", "fault spec, e.g. 'rate_limit=0.1,timeout=0.05' ('' = no faults; --faults sets it); the API changes 'param_renamed=0.2,tool_moved=0.2' are the share of (episode, tool) pairs changed, sticky for the episode (`reflrl faults list`)")
    fault_seed: int | None = _f(None, "seed of the fault stream; null = derived from the env seed")
    reward: str = _f("binary", "reward name in reflrl.envs.rewards: 'binary' (exact match, efficiency paper (arXiv:2606.00135) eq. 8) | 'fine' (DSCL) | ...")
    parser: str = _f("hermes", "tool-call parser: 'hermes' | 'pythonic' | 'react' | 'auto'")
    max_steps: int | None = _f(None, "assistant messages per episode before truncation; null = env default")
    retry: RetryConfig = _f(RetryConfig, "retry policy of the tool client")
    fault_exposure: str = _f("policy", "who meets a fault the tool client does not absorb: 'client' (its retries; a fault they give up on masks the rollout, never penalised) | 'policy' (it comes back to the policy as the tool's answer - HTTP status, error code, message, Retry-After - and the episode goes on, so the policy may call again, call another tool or stop; a fault it could have acted on and did not is a wrong answer, one no action can handle stays masked: `reflrl faults list`; attempts per call: env.retry.policy_max_attempts)")
    turn_seconds: float = _f(2.0, "fault_exposure='policy': virtual seconds on the env's clock that each assistant message after the first costs (no wall time); a call made before a 429's Retry-After has passed is refused with 429 again")
    triage: bool = _f(True, "mask a rollout that met a fault it could not act on (the client gave up; with fault_exposure='policy', a fault no action can handle), so it is never penalised; false = no triage, every such fault leaves the answer wrong (what a plain RL trainer does with tool errors: the 'naive' baseline)")
    train_fault_scale: float = _f(3.0, "the RL rollouts and reflection retries meet every fault kind of env.faults at this multiple of its rate (their total at most env.train_fault_cap); the held-out evaluations meet env.faults as given. Faults are rare, so at the rate a user runs with few rollouts of a step meet one: a scale above 1 drills the policy on them")
    train_fault_cap: float = _f(0.5, "the highest total fault rate per call attempt that env.train_fault_scale raises the RL rollouts' faults to (and, apart, the highest share of (episode, tool) pairs with an API change)")
    eval_fault_seed: int = _f(1234, "seed of the faults the held-out evaluations meet (env.faults): fixed, so every checkpoint of a run meets the same faults")
    concurrency: int = _f(16, "episodes stepped concurrently (1 = one at a time)")


@dataclass
class RolloutConfig:
    """Sampling of rollouts (see reflrl.rollout)."""

    n: int = _f(8, "rollouts per prompt (the GRPO group size)")
    batch_prompts: int = _f(2, "prompts per training step")
    temperature: float = _f(0.7, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling threshold (1.0 = off)")
    max_new_tokens: int = _f(256, "new tokens per assistant turn at most (every task)")
    answer_cap: float | None = _f(1.5, "per-task token cap sized to the gold answer: ceil(answer_cap x the gold answer's tokens) + 16 (+ 128 with a <think> block), at most max_new_tokens; every answer to a single-turn task (the first, and each one after a fault the policy is shown), in rollouts, reflection retries and evaluation alike; null = max_new_tokens for every task")
    stop_at_complete: bool = _f(True, "stop an answer as soon as it is complete: the end of the turn, or the end of its tool-call block(s) when other text follows (hermes format; reflrl.envs.parsing.answer_complete)")
    max_turns: int = _f(1, "assistant turns per episode (multi-turn envs)")
    max_total_tokens: int = _f(1024, "prompt + response token cap for multi-turn episodes")
    engine: str = _f("transformers", "who samples the RL rollouts: 'transformers' (the trained model itself, in process) | 'vllm' (vLLM offline engine on one GPU, weights pushed after every update: on-policy; needs the gpu extra) | 'openai' (an OpenAI-compatible server with its OWN weights, never synced: needs engine_off_policy=true; docs/scale-out.md)")
    engine_base_url: str | None = _f(None, "engine='openai': the server's base URL, e.g. http://127.0.0.1:8000/v1 (needs /v1/completions with token-id prompts, as vllm serve)")
    engine_model: str | None = _f(None, "engine='openai': the served model name; null = model.name")
    engine_off_policy: bool = _f(False, "engine='openai': accept that rollouts come from the server's frozen weights while the local model trains (off-policy after the first update, no importance correction)")
    continuous: bool = _f(True, "engine='transformers': continuous batching (reflrl.engines.continuous): the rollouts' answers, the turns after a fault, the reflection retries and the held-out evaluations decode in one loop whose finished rows are refilled at once from the waiting requests, each answer submitted as soon as its episode is ready; each row samples from its own stream seeded by (request seed, sample index), and the loop waits for an episode's tool step before its next decode step, so the samples follow from the seed, not from when a tool answered. false = one engine call per batch of ready episodes (fixed batches; other seeds, so other samples; which episodes share a batch can depend on when their tool steps end)")
    packed_weights: str = _f("auto", "engine='transformers': decode steps and prefills multiply by float32 weights packed once for oneDNN (all of a float32 model's; the head and the float32 trainable layers of a bfloat16 one), and so do the frozen float32 layers of the training forwards (reflrl.engines.packed; the same products up to float rounding, about 0.26 GB more memory for the 135M model): 'auto' = where a sub-second measurement at the decode shapes finds it faster on this CPU (cached per CPU model) | 'true' | 'false'")
    decode_attention: str = _f("auto", "engine='transformers': the decode step's one-token attention: 'native' = a small C kernel compiled on this machine at first use (reflrl.engines.native_attention: cc, about a second, cached; each row reads only its own keys and values, in float32; it also runs the step's rotary embedding, cache write and RMSNorms; the same results as SDPA and torch's operations up to float rounding) | 'sdpa' = PyTorch's scaled_dot_product_attention | 'auto' = the kernel where it builds, agrees with SDPA and a sub-second measurement at a decode shape finds it faster on this CPU (cached per CPU model), else SDPA")
    decode_matmul: str = _f("auto", "engine='transformers': the generation's matmuls (decode steps and prefills; also the frozen layers' training forwards): 'native' = a small C kernel compiled on this machine with the attention's (reflrl.engines.native_matmul: float32 on AVX2 or AVX-512, bfloat16 on AVX512-BF16) over weights laid out once for it, in place of rollout.packed_weights' copies (each row's products independent of the other rows; the same results as PyTorch's up to float rounding) | 'torch' = PyTorch's products | 'auto' = the kernel for each dtype where it builds, agrees with PyTorch and a sub-second measurement at the decode shapes finds it faster on this CPU (cached per CPU model)")
    kv_budget_mb: float | None = _f(512.0, "the KV cache of generation (rollouts, retries, evaluations) holds at most this many MiB (rows x the longest prompt + cap x bytes per token): with continuous=true requests that do not fit wait for rows to finish; otherwise each fixed batch takes as many prompts as fit; null = no limit beyond the engine's rows")


@dataclass
class AlgoConfig:
    """The RL algorithm (see reflrl.algos)."""

    advantage: str = _f("grpo", "advantage estimator: 'grpo' (efficiency paper, arXiv:2606.00135, eq. 2) | 'dr_grpo' | 'rloo' | 'gae' (PPO: per-token GAE from a value head on the policy's trunk, trained with the clipped value loss)")
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
    sft_coef: float = _f(1.0, "weight of a supervised loss on the clean demonstrations (the warm-up's gold answers) added to every RL update, so RL keeps what the warm-up taught (InstructGPT's PPO-ptx, arXiv:2203.02155 sec. 3.5: the pretraining mix); 0 = off")
    sft_batch: int = _f(4, "demonstrations per RL update in the supervised loss (algo.sft_coef > 0), drawn by the step's seed")
    value_coef: float = _f(0.5, "critic loss weight (advantage='gae')")
    value_clip: float | None = _f(0.2, "critic value clip range (advantage='gae'); null = off")
    lr: float = _f(5e-5, "policy learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "max global grad norm (0 = no clipping)")
    epochs_per_batch: int = _f(1, "optimisation passes over each rollout batch (1 = on-policy)")
    micro_batch_size: int = _f(8, "sequences per forward/backward (gradient accumulation over the batch)")
    activation_budget_mb: float | None = _f(640.0, "memory (MB) that one training forward/backward may hold in activations and log-prob logits, estimated from the model's shape (reflrl.memory): an RL micro-batch or a warm-up batch over it is split into smaller ones with gradient accumulation (the same update up to float rounding); a single sequence over it runs alone; null = no limit (only micro_batch_size)")
    downsample_m: int = _f(0, "max-variance down-sampling (efficiency paper, arXiv:2606.00135, sec. 4.2): train on m of n rollouts; 0 = off")
    prefilter_k: int = _f(1, "online pre-rollout filter (efficiency paper, arXiv:2606.00135, sec. 4.1): skip prompts all-correct for k epochs; 0 = off")


@dataclass
class SamplingConfig:
    """Prompt-level dynamic sampling and the DSCL curriculum (reflrl.algos.dscl)."""

    sampler: str = _f("none", "group filter after rollouts: 'none' | 'dapo' (DAPO dynamic sampling: drop the groups whose rewards are all equal; with refill=true the batch is refilled) | 'smv' (max variance) | 'smr' (mean reward band) | 'rds' (DSCL sec. 4.2)")
    warmup_gate: bool = _f(True, "the sampler acts only after the format stage converged (DSCL sec. 6.4, Table 3); false = from the first step")
    refill: bool = _f(False, "sample more prompts to refill the batch after filtering, as DAPO does (DSCL trains on the kept part only)")
    max_refill_rounds: int = _f(3, "refill: extra sampling rounds per step at most")
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
    """Supervised warm-up on the training split's gold calls and on following a critique of a policy
    error (reflrl.sft, reflrl.train.warmup)."""

    enabled: Union[str, bool] = _f("auto", "'auto' (run when the format rate < threshold) | true | false")
    format_rate_threshold: float = _f(0.5, "auto: warm up when fewer than this share of probe samples parse")
    probe_n: int = _f(0, "tasks sampled (at the rollout temperature) to measure the format rate; 0 = use the greedy answers of the held-out evaluation before (no extra generation)")
    steps: int = _f(60, "SFT optimiser steps")
    lr: float = _f(5e-4, "SFT learning rate")
    batch_size: int = _f(4, "SFT examples per step")
    time_budget_min: float | None = _f(None, "guard: cut the warm-up after this many minutes (reported as a cut: the result is then not the recipe's); null = no limit")
    eval_after: bool = _f(True, "evaluate the held-out split right after the warm-up, so the summary tells the warm-up's gain from RL's (one more evaluation)")
    critique_share: float = _f(0.0, "share of the warm-up's examples that teach following a critique (the rest are the gold demonstrations): each is the retry prompt q* of a policy error, as the RL phase's reflection retries build it (a gold call made wrong: the wrong tool, a wrong value or a dropped argument; seeded), with the rule critic's analysis naming the fix, and the gold call as the target; none shows a tool error or a fault (reflrl.recovery.critique_examples); 0 = gold demonstrations only")
    rename_share: float = _f(0.0, "share of the warm-up's examples (gold demonstrations and critique examples alike) made on a task whose catalogue has one name renamed (a parameter of the gold call or the gold tool, from seeded pools of plausible names), in the prompt's tool list and in the target: the policy learns to take names from its context, not from memory. A renamed task's critique example shows the call with the name as it was and the critique naming the call to make (reflrl.recovery.critique_examples.renamed_task); none shows a tool error or an API change; 0 = off")
    critique_reveal: str = _f("call", "the rule critic's level in the critique examples' feedback, one that names the fix: 'value' (the expected values) | 'call' (+ the whole expected call) | 'answer' (the same, in the policy's answer format); see reflection.reveal")


@dataclass
class TrainConfig:
    """The run: length, evaluation, checkpoints, logging."""

    steps: int = _f(8, "RL training steps")
    time_budget_min: float | None = _f(60.0, "guard on the whole run's minutes: a phase it would overrun (warm-up, RL) is cut, the final evaluation still runs, and the run says loudly that its result is not the recipe's (summary 'budget_cut', exit status 3); null = no limit")
    rl_minutes: float | None = _f(None, "equal-time stopping rule: start no RL step that would end after this many minutes of RL steps (by the last steps' mean), train.steps staying the ceiling; the steps done then depend on the machine's speed and load, and the summary and printed result say so (stop_reason 'rl_minutes'); null = off")
    eval_before: bool = _f(True, "evaluate the held-out split before training (the base model, or model.init_from); its greedy answers also give warmup.enabled=auto its format rate; false skips it (then warmup.enabled must be true or false, or warmup.probe_n > 0)")
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

    variant: str = _f("tool_rerl", "method by name (Tool-ReRL Table 1/2): 'grpo' (no reflection) | 'ppo' (no reflection; needs algo.advantage=gae: a value head, GAE and the clipped value loss; configs/ppo.yaml) | 'cot' (thought then call) | 'ref' (repaired trajectories trained as on-policy, no correction) | 'cot_is' (own thought in q*, importance-weighted) | 'external' / 'external_is' (reasoning from the critic endpoint, without / with the weight) | 'tool_rerl' (critic reflection + eq. 2) | 'dpo' (DPO on failure/repair pairs)")
    critic: str = _f("rule", "frozen critic for 'ref', 'tool_rerl', 'dpo': 'rule' (embedded, no model) | 'llm' (critic_base_url) | 'policy' (the policy itself)")
    critic_base_url: str | None = _f(None, "OpenAI-compatible endpoint of the 'llm' critic and the 'external*' variants, e.g. http://127.0.0.1:8000/v1 (python -m reflrl.chat_server)")
    critic_model: str | None = _f(None, "model the critic endpoint is asked for; null = the one model it serves (as GET /v1/models lists it). The endpoint is checked before the first step: it must answer and serve this model")
    critic_timeout_s: float = _f(60.0, "per-request timeout of the critic endpoint (seconds)")
    reveal: str = _f("query", "rule critic: how much of an expected value the analysis gives away: 'none' | 'query' (the request's span that holds it) | 'value' (the expected values) | 'call' (value + the whole expected answer) | 'answer' (the same, written in the policy's answer format)")
    max_attempts: int = _f(1, "retries sampled under q* per failed trajectory, stopping at the first positive (Definition 1 ii)")
    max_per_step: int = _f(4, "at most this many failed trajectories reflected on per step (env faults first); 0 = all")
    eval_policy_errors: int | None = _f(8, "held-out evaluations under faults: reflection retries every fault-caused failure and at most this many policy errors (the first by task order), so the policy-error repair rate is a sample; null = every failure")
    reflect_on: str = _f("failure", "which failures are reflected on: 'failure' (env faults and policy errors) | 'env_fault' (only env faults)")
    mode: str = _f("replace", "how q* is rendered: 'replace' (the user message becomes appendix C's retry prompt) | 'append' (attempt + retry prompt appended)")
    group: str = _f("add", "how a repair enters its GRPO group: 'replace' (tau* takes the failed rollout's place, as the paper's transformed trajectory) | 'add' (tau* joins the group beside the failure, which keeps its negative advantage)")
    think: bool | None = _f(None, "ask for a <think> block before the calls; null = the variant's default (true for cot and cot_is)")
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
# Every rule a config must satisfy is one small named check below, registered for its section with
# @_check(section); validate() runs them all and reports every problem at once. A check yields one
# message per problem. Names chosen from a registry (algorithms, samplers, variants, critics, engines,
# parsers, ...) are checked against that registry (reflrl.registry.names), never against a list
# written out here. The checks marked trainer=True are the CPU trainer's own limits: a config that
# fails them is still valid for the verl backend; check_trainer() runs them (reflrl train, Trainer).
Problems = Iterator[str]
_CHECKS: list[tuple[str, Callable[["Config"], Problems]]] = []
_TRAINER_CHECKS: list[tuple[str, Callable[["Config"], Problems]]] = []


def _check(section: str, *, trainer: bool = False) -> Callable:
    """Register a check of ``section`` (``trainer=True``: a limit of the CPU trainer only)."""
    def add(fn: Callable[["Config"], Problems]) -> Callable[["Config"], Problems]:
        (_TRAINER_CHECKS if trainer else _CHECKS).append((section, fn))
        return fn
    return add


def registered(kind: str) -> list[str]:
    """The names of ``kind`` a config may choose (``reflrl.registry.DIRECTORY``: advantage, policy_loss,
    sampler, variant, critic, engine, reveal, parser, ...), names registered by a plugin included.
    Imports the registry's module when called, not when this module is imported (no torch at import)."""
    from reflrl.registry import names

    return names(kind)


def _one_of(path: str, value: Any, kind_or_choices: str | tuple) -> Problems:
    """A problem unless ``value`` is a registered name of ``kind`` (or one of the given choices)."""
    choices = registered(kind_or_choices) if isinstance(kind_or_choices, str) else list(kind_or_choices)
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        yield f"{path}: {value!r} is not one of {', '.join(map(str, choices))}{hint}"


def _at_least(section: Any, prefix: str, low: float, *names: str, strict: bool = False) -> Problems:
    """``prefix.name >= low`` (``> low`` with strict) for each name."""
    for name in names:
        v = getattr(section, name)
        if v < low or (strict and v == low):
            yield f"{prefix}.{name}: must be {'>' if strict else '>='} {low:g}, got {v}"


def _in_unit(section: Any, prefix: str, *names: str) -> Problems:
    for name in names:
        v = getattr(section, name)
        if not 0 <= v <= 1:
            yield f"{prefix}.{name}: must be in [0, 1], got {v}"


@_check("model")
def _model(cfg: "Config") -> Problems:
    m = cfg.model
    yield from _one_of("model.dtype", m.dtype, "dtype")
    if m.trainable_dtype is not None:
        yield from _one_of("model.trainable_dtype", m.trainable_dtype, tuple(d for d in registered("dtype") if d != "auto"))
    t = m.trainable
    if t not in ("all", "none", "lora"):
        k = t.split(":", 1)[1] if t.startswith("top_layers:") else ""
        if not (k.isdigit() and int(k) >= 1):
            yield f"model.trainable: {t!r} is not 'all', 'none', 'lora' or 'top_layers:K' with K >= 1"
    yield from _at_least(m, "model", 1, "lora_r")
    if not 0.0 <= m.lora_dropout < 1.0:
        yield f"model.lora_dropout: must be in [0, 1), got {m.lora_dropout}"
    if m.init_from is not None and not (Path(str(m.init_from)).expanduser() / "trainable.pt").is_file():
        yield (f"model.init_from: {m.init_from} is not a reflrl checkpoint folder (no trainable.pt; "
               "expected RUN/checkpoints/step_N)")


@_check("data")
def _data(cfg: "Config") -> Problems:
    d = cfg.data
    yield from _at_least(d, "data", 1, "n_train")
    yield from _at_least(d, "data", 0, "n_val", "n_test")
    if not d.kinds:
        yield "data.kinds: must list at least one task kind"
    yield from _one_of("data.prompt_style", d.prompt_style, "prompt_style")


def train_faults(e: "EnvConfig") -> str:
    """The fault spec the RL rollouts and reflection retries meet: ``env.faults`` with every rate times
    ``env.train_fault_scale`` (total at most ``env.train_fault_cap``; :meth:`reflrl.faults.FaultPlan.scaled`).
    The held-out evaluations meet ``env.faults`` itself."""
    if not e.faults or e.train_fault_scale == 1.0:
        return e.faults
    from reflrl.faults import FaultPlan
    return str(FaultPlan.parse(e.faults).scaled(e.train_fault_scale, e.train_fault_cap))


@_check("env")
def _env(cfg: "Config") -> Problems:
    v = cfg.env
    yield from _one_of("env.parser", v.parser, "parser")
    if v.max_steps is not None and v.max_steps < 1:
        yield f"env.max_steps: must be >= 1 or null, got {v.max_steps}"
    yield from _at_least(v.retry, "env.retry", 1, "max_attempts", "policy_max_attempts")
    yield from _one_of("env.fault_exposure", v.fault_exposure, ("client", "policy"))
    yield from _at_least(v, "env", 0, "turn_seconds", "train_fault_scale")
    if not 0 < v.train_fault_cap <= 1:
        yield f"env.train_fault_cap: must be in (0, 1], got {v.train_fault_cap}"
    yield from _at_least(v.retry, "env.retry", 0, "budget_s", strict=True)
    yield from _at_least(v, "env", 1, "concurrency")


@_check("rollout")
def _rollout(cfg: "Config") -> Problems:
    r = cfg.rollout
    yield from _at_least(r, "rollout", 1, "n", "batch_prompts", "max_new_tokens", "max_turns")
    yield from _at_least(r, "rollout", 0, "temperature", strict=True)
    if not 0 < r.top_p <= 1:
        yield f"rollout.top_p: must be in (0, 1], got {r.top_p}"
    if r.answer_cap is not None and r.answer_cap < 1.0:
        yield f"rollout.answer_cap: must be >= 1 (a multiple of the gold answer's length) or null, got {r.answer_cap}"
    if r.max_total_tokens < r.max_new_tokens:
        yield f"rollout.max_total_tokens: must be >= rollout.max_new_tokens ({r.max_new_tokens}), got {r.max_total_tokens}"
    if r.kv_budget_mb is not None and r.kv_budget_mb <= 0:
        yield f"rollout.kv_budget_mb: must be > 0 (MiB) or null, got {r.kv_budget_mb}"


@_check("rollout")
def _rollout_engine(cfg: "Config") -> Problems:
    r = cfg.rollout
    yield from _one_of("rollout.engine", r.engine, "engine")
    if r.engine == "openai":
        if not r.engine_base_url:
            yield "rollout.engine_base_url: rollout.engine='openai' needs the server's URL, e.g. http://127.0.0.1:8000/v1"
        if not r.engine_off_policy:
            yield ("rollout.engine='openai': the server samples from its own weights and the trainer cannot sync "
                   "the updated policy to it (an OpenAI-compatible API has no weight upload), so every rollout "
                   "after the first update is off-policy and uncorrected; set rollout.engine_off_policy=true to "
                   "train that way anyway, or use rollout.engine='transformers' or rollout.engine='vllm' "
                   "(on-policy, weights pushed after every update; GPU))")


@_check("algo")
def _algo_names(cfg: "Config") -> Problems:
    a = cfg.algo
    yield from _one_of("algo.advantage", a.advantage, "advantage")
    yield from _one_of("algo.policy_loss", a.policy_loss, "policy_loss")
    yield from _one_of("algo.loss_agg", a.loss_agg, "loss_agg")
    yield from _one_of("algo.kl_estimator", a.kl_estimator, "kl_estimator")


@_check("algo")
def _algo_ranges(cfg: "Config") -> Problems:
    a, r = cfg.algo, cfg.rollout
    if not 0 <= a.clip_low < 1:
        yield f"algo.clip_low: must be in [0, 1), got {a.clip_low}"
    yield from _at_least(a, "algo", 0, "clip_high", "kl_coef", "entropy_coef", "value_coef", "weight_decay",
                         "grad_clip", "adv_eps", "prefilter_k", "sft_coef")
    yield from _at_least(a, "algo", 1, "sft_batch")
    yield from _at_least(a, "algo", 0, "lr", strict=True)
    yield from _at_least(a, "algo", 1, "epochs_per_batch", "micro_batch_size")
    if a.activation_budget_mb is not None:
        yield from _at_least(a, "algo", 0, "activation_budget_mb", strict=True)
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        yield f"algo.dual_clip_c: must be > 1 or null, got {a.dual_clip_c}"
    yield from _in_unit(a, "algo", "gamma", "lam")
    if a.value_clip is not None and a.value_clip <= 0:
        yield f"algo.value_clip: must be > 0 or null, got {a.value_clip}"
    if not (a.downsample_m == 0 or 2 <= a.downsample_m < r.n):
        yield f"algo.downsample_m: must be 0 (off) or in 2..rollout.n-1 = {r.n - 1}, got {a.downsample_m}"


@_check("sampling")
def _sampling(cfg: "Config") -> Problems:
    s = cfg.sampling
    yield from _one_of("sampling.sampler", s.sampler, "sampler")
    yield from _in_unit(s, "sampling", "keep_a", "keep_b1", "keep_b2", "keep_c1", "keep_c2",
                        "format_threshold", "name_threshold", "key_threshold")
    yield from _at_least(s, "sampling", 0, "t_var", "max_refill_rounds")
    if not 0 < s.smv_keep <= 1:
        yield f"sampling.smv_keep: must be in (0, 1], got {s.smv_keep}"
    if not 0 <= s.smr_low <= s.smr_high <= 1:
        yield f"sampling.smr_low/smr_high: need 0 <= smr_low <= smr_high <= 1, got {s.smr_low}, {s.smr_high}"
    if s.window is not None and s.window < 1:
        yield f"sampling.window: must be >= 1 or null, got {s.window}"
    if s.curriculum and not cfg.env.reward.startswith("fine"):
        yield f"sampling.curriculum: needs a fine-grained reward (env.reward='fine'), got env.reward={cfg.env.reward!r}"


@_check("warmup")
def _warmup(cfg: "Config") -> Problems:
    w = cfg.warmup
    if w.enabled not in ("auto", True, False):
        yield f"warmup.enabled: expected 'auto', true or false, got {_show(w.enabled)}"
    yield from _in_unit(w, "warmup", "format_rate_threshold")
    if not 0 <= w.critique_share < 1:
        yield f"warmup.critique_share: must be in [0, 1) (the rest of the examples are gold demonstrations), got {w.critique_share}"
    yield from _one_of("warmup.critique_reveal", w.critique_reveal, ("value", "call", "answer"))
    if not 0 <= w.rename_share <= 1:
        yield f"warmup.rename_share: must be in [0, 1], got {w.rename_share}"
    yield from _at_least(w, "warmup", 0, "steps", "probe_n")
    yield from _at_least(w, "warmup", 1, "batch_size")
    yield from _at_least(w, "warmup", 0, "lr", strict=True)


@_check("train")
def _train(cfg: "Config") -> Problems:
    tr = cfg.train
    yield from _at_least(tr, "train", 0, "steps", "eval_every", "save_every")
    yield from _at_least(tr, "train", 1, "log_every", "keep_checkpoints")
    for name in ("rl_minutes", "time_budget_min"):
        v = getattr(tr, name)
        if v is not None and v <= 0:
            yield f"train.{name}: must be > 0 or null, got {v}"
    if tr.threads is not None and tr.threads < 1:
        yield f"train.threads: must be >= 1 or null, got {tr.threads}"
    if not tr.eval_before and cfg.warmup.enabled == "auto" and cfg.warmup.probe_n == 0:
        yield ("train.eval_before=false: warmup.enabled='auto' takes its format rate from that evaluation; "
               "set warmup.enabled to true or false, or warmup.probe_n > 0")
    yield from _one_of("train.device", tr.device, ("auto", "cpu", "cuda"))
    if tr.run_name is not None and (tr.run_name in ("", ".", "..") or "/" in tr.run_name or "\\" in tr.run_name):
        yield f"train.run_name: must be a plain folder name, got {tr.run_name!r}"


def _variant(cfg: "Config") -> Any:
    """The registered entry of ``reflection.variant`` (a reflrl.recovery.variants.Variant)."""
    from reflrl.registry import lookup

    return lookup("variant").get(cfg.reflection.variant)


@_check("reflection")
def _reflection_names(cfg: "Config") -> Problems:
    f = cfg.reflection
    yield from _one_of("reflection.variant", f.variant, "variant")
    yield from _one_of("reflection.critic", f.critic, "critic")
    yield from _one_of("reflection.reveal", f.reveal, "reveal")
    yield from _one_of("reflection.mode", f.mode, "reflection_mode")
    yield from _one_of("reflection.level", f.level, "importance_level")
    yield from _one_of("reflection.reflect_on", f.reflect_on, ("failure", "env_fault"))
    yield from _one_of("reflection.group", f.group, ("replace", "add"))
    yield from _at_least(f, "reflection", 1, "max_attempts")
    yield from _at_least(f, "reflection", 0, "max_per_step")
    if f.eval_policy_errors is not None:
        yield from _at_least(f, "reflection", 0, "eval_policy_errors")
    yield from _at_least(f, "reflection", 0, "log_cap", "dpo_beta", "critic_timeout_s", strict=True)


@_check("reflection")
def _reflection_needs(cfg: "Config") -> Problems:
    f = cfg.reflection
    if f.variant not in registered("variant"):
        return  # named above
    v = _variant(cfg)
    if v.reflect and cfg.rollout.max_turns != 1:
        yield (f"reflection.variant={f.variant!r} repairs single-step tasks (the paper's ToolACE setting); "
               f"got rollout.max_turns={cfg.rollout.max_turns}")
    if (v.source == "external" or (v.reflect and f.critic == "llm")) and not f.critic_base_url:
        yield (f"reflection.variant={f.variant!r} with an LLM critic needs reflection.critic_base_url (an "
               "OpenAI-compatible endpoint, e.g. `python -m reflrl.chat_server --model NAME --port 8000` -> "
               "http://127.0.0.1:8000/v1)")


@_check("algo", trainer=True)
def _cpu_algo(cfg: "Config") -> Problems:
    a = cfg.algo
    if a.entropy_coef > 0:
        yield ("algo.entropy_coef>0: the CPU trainer computes log-probs of the sampled tokens only, not the "
               "full-vocabulary logits an entropy bonus needs (the verl backend has them)")
    if cfg.reflection.variant == "ppo" and a.advantage != "gae":
        yield f"reflection.variant='ppo' trains with a value head and GAE: set algo.advantage=gae (got {a.advantage!r})"


@_check("model", trainer=True)
def _cpu_model(cfg: "Config") -> Problems:
    if cfg.model.trainable == "none":
        yield "model.trainable='none' leaves no trainable parameter: training needs 'all', 'lora' or 'top_layers:K'"


@_check("reflection", trainer=True)
def _cpu_variant(cfg: "Config") -> Problems:
    if cfg.reflection.variant not in registered("variant"):
        return
    v = _variant(cfg)
    if v.cpu_error:
        yield v.cpu_error
    if v.dpo and cfg.algo.epochs_per_batch != 1:
        yield "reflection.variant='dpo' makes one DPO step per batch; set algo.epochs_per_batch=1"


def _run(checks: list[tuple[str, Callable[["Config"], Problems]]], cfg: "Config", what: str) -> "Config":
    problems = [msg for _, fn in checks for msg in fn(cfg)]
    if problems:
        raise ConfigError(f"{what}:\n  " + "\n  ".join(problems))
    return cfg


def validate(cfg: Config) -> Config:
    """Run every section's checks; raise one ConfigError listing all problems, else return ``cfg``."""
    return _run(_CHECKS, cfg, "invalid config")


def check_trainer(cfg: Config) -> Config:
    """The CPU trainer's limits on top of :func:`validate` (e.g. no value head for GAE/PPO); raises one
    ConfigError listing what this trainer cannot run. ``reflrl train`` and ``Trainer`` call it."""
    return _run(_TRAINER_CHECKS, validate(cfg), "the CPU trainer cannot run this config")


def checks() -> dict[str, list[str]]:
    """Section -> the names of its checks (trainer-only checks marked), for documentation and tests."""
    out: dict[str, list[str]] = {}
    for section, fn in _CHECKS:
        out.setdefault(section, []).append(fn.__name__.lstrip("_"))
    for section, fn in _TRAINER_CHECKS:
        out.setdefault(section, []).append(fn.__name__.lstrip("_") + " (trainer)")
    return out


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

    Missing keys take the defaults (the default recipe). A top-level ``base: FILE`` (relative to the
    file's folder) lays the file over FILE: FILE's keys first, this file's keys over them, key by key.
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
