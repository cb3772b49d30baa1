"""Train the embedded model with TRL's GRPOTrainer on reflrl's fault-injecting tools (CPU).

    pip install -e '.[trl]'
    python examples/trl_grpo_faults.py --faults rate_limit=0.1 --steps 3

Every tool call the model makes goes through reflrl's client to the in-process tool server, which
injects the faults of ``--faults``; the client retries them (honouring Retry-After) and the
ledger records every injected fault and every attempt. After each step the script prints the
ledger's totals and the step's wall time; at the end the totals, the injected/observed
reconciliation and the mean wall time per step. Rollouts whose calls ended on an unrecovered env
fault are kept out of the loss (their reward is None; see reflrl.integrations.trl).

The model runs in float32: bfloat16 is emulated on CPUs without native support and much slower.
Zero-shot, SmolLM2-135M-Instruct rarely writes a tool call, so few calls (and faults) happen in a
few steps; pass a warmed-up checkpoint folder with ``--model`` to see more.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--faults", default="rate_limit=0.1",
                    help="fault spec kind=prob[:param],... (see 'reflrl faults list')")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model registry name, HF id or checkpoint folder")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps")
    ap.add_argument("--prompts-per-step", type=int, default=2, help="tasks per step")
    ap.add_argument("--num-generations", type=int, default=4, help="completions per task (GRPO group)")
    ap.add_argument("--max-completion-length", type=int, default=64,
                    help="tokens per completion, tool results included")
    ap.add_argument("--tools", default="get_current_weather,get_stock_quote,search_flights",
                    help="comma-separated catalogue tools offered to the model")
    ap.add_argument("--n-tasks", type=int, default=32, help="synthetic tasks to draw from")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seed of tasks, faults and training")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute activations in the backward pass (less memory, slower)")
    ap.add_argument("--out", default=None, help="TRL output folder (default: a temporary folder)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from reflrl.faults import FaultPlan, FaultSpecError

    try:
        plan = FaultPlan.parse(args.faults)
    except FaultSpecError as e:
        print(f"trl_grpo_faults: --faults: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reflrl.integrations.trl import ToolEnvironmentFactory, use_tool_chat_template
    from reflrl.models import load_model

    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype="float32")
    tok = use_tool_chat_template(tok)
    factory = ToolEnvironmentFactory(tools=[t for t in args.tools.split(",") if t], faults=plan,
                                     seed=args.seed, n_tasks=args.n_tasks, dataset_seed=args.seed)
    print(f"model {args.model} (float32) loaded in {time.perf_counter() - t0:.1f}s; faults: "
          f"{plan or 'none'}; {len(factory.tasks)} tasks, tools {args.tools}", flush=True)

    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            step_times.append(time.perf_counter() - self.t)
            print(f"[reflrl] step {state.global_step}: wall time {step_times[-1]:.1f}s", flush=True)

    out = args.out or tempfile.mkdtemp(prefix="reflrl-trl-")
    config = GRPOConfig(
        output_dir=out, max_steps=args.steps, seed=args.seed, learning_rate=args.lr,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=2, beta=0.0, bf16=False, use_cpu=True,
        gradient_checkpointing=args.gradient_checkpointing, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=model, processing_class=tok, args=config,
                          train_dataset=factory.dataset(), environment_factory=factory,
                          reward_funcs=[factory.reward("binary")],
                          callbacks=[StepTimer(), factory.callback()])
    try:
        trainer.train()
    finally:
        factory.close()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    totals = factory.ledger.totals()
    print("\n== fault ledger ==")
    print(totals.format())
    print("injected: " + (", ".join(f"{k}={v}" for k, v in sorted(totals.injected_by_kind.items()))
                          or "none"))
    print(factory.ledger.reconcile().format())
    print(f"tool calls per completion (TRL): "
          f"{[round(h.get('tools/call_frequency', 0.0), 3) for h in logs]}; "
          f"reward: {[round(h['reward'], 3) for h in logs]}; masked fraction: "
          f"{[round(h.get('reflrl/masked_fraction', 0.0), 3) for h in logs]}")
    if step_times:
        print(f"wall time per step: median {statistics.median(step_times):.1f}s "
              f"({', '.join(f'{t:.1f}' for t in step_times)}); total {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
