"""The ``reflrl`` command line.

Subcommands::

    reflrl env demo   [--faults SPEC] [--model NAME] [--n-tasks 5] [--seed 0] ...
    reflrl env check  [--id ID ...]
    reflrl tools serve [--host 127.0.0.1] [--port 8077] [--seed 0]
    reflrl faults list
    reflrl faults proxy --upstream URL --faults SPEC [--seed 0] [--port 8078]
    reflrl train [--config F] [--faults SPEC] [--set k=v] ...   (reflrl.cli.train)
    reflrl eval rotbench taskbench bfcl sealtools --model NAME ...  /  reflrl eval compare RUN_A RUN_B
    reflrl data list  /  reflrl data download rotbench|taskbench|sealtools [--dest DIR]
    reflrl experiment faults --methods grpo,tool_rerl --faults "rate_limit=0,0.1;timeout=0,0.1" --seeds 3
    reflrl report RUN_OR_SWEEP_DIR

Every subcommand imports what it needs when it runs (``reflrl faults list`` never loads torch).
One handler (:func:`main`) turns reflrl's errors (:mod:`reflrl.errors`) into one clear line and the
exit status of their class: 2 for the user's input (a bad config key, ``--faults`` spec, grid, data
file, unknown name), 3 for a run a time budget cut, 4 for a missing resource (disk space). Any other
exception is a bug: it is shown with its traceback and a request to report it (exit status 1).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from reflrl.errors import UserError

EXIT_BUG = 1
BUG_REPORT = ("reflrl: this is a bug in reflrl, not a problem with your input; please report it with the "
              "command line and the traceback above")


def _fault_spec(text: str) -> str:
    """argparse type for --faults: validates the spec now (FaultSpecError names the bad entry)."""
    from reflrl.faults.spec import FaultPlan, FaultSpecError

    try:
        return str(FaultPlan.parse(text)) or "none"
    except FaultSpecError as e:
        raise UserError(f"--faults: {e}") from None


def _port(text: str) -> int:
    """argparse type for --port: a whole number in 0..65535 (0 = any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535; 0 picks a free one)")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``reflrl`` command (every flag has help text)."""
    p = argparse.ArgumentParser(
        prog="reflrl",
        description="Reinforcement learning for LLM tool calling through misbehaving tools.")
    from reflrl import __version__

    p.add_argument("--version", action="version", version=f"reflrl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    # ---- env ---------------------------------------------------------------------------
    env = sub.add_parser("env", help="tool-calling Gymnasium environments (demo, check)",
                         description="Tool-calling Gymnasium environments.")
    env_sub = env.add_subparsers(dest="env_command", metavar="ENV_COMMAND")
    env_sub.required = True

    demo = env_sub.add_parser(
        "demo", help="a real episode demo: the model answers tasks against fault-injecting tools",
        description="Load a model, let it answer a handful of synthetic tasks in the tool env "
                    "with fault injection, and print each call, fault, retry and triage, then the "
                    "fault ledger's totals.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--faults", default="rate_limit=0.1", type=str,
                      help="fault spec kind=prob[:param],... (see 'reflrl faults list'), or 'none'")
    demo.add_argument("--model", default="smollm2-135m-instruct",
                      help="model registry name (smollm2-135m-instruct = the embedded GGUF; "
                           "tiny-random = a tiny random model for smoke tests), HF id or folder")
    demo.add_argument("--n-tasks", type=int, default=5, help="number of tasks to run")
    demo.add_argument("--seed", type=int, default=0,
                      help="env seed: picks the tasks, the tool data and the fault schedule")
    demo.add_argument("--split", default="test", choices=("train", "val", "test"),
                      help="split of the synthetic dataset to draw tasks from")
    demo.add_argument("--dataset", default="synthetic",
                      help="'synthetic' or a ToolACE/xLAM/Hammer JSON(L) file")
    demo.add_argument("--multi-turn", action="store_true",
                      help="use reflrl/ToolCallMultiTurn-v0 (assistant and tool messages alternate)")
    demo.add_argument("--parser", default="hermes", choices=("hermes", "pythonic", "react", "auto"),
                      help="tool-call format the prompt asks for and the env parses")
    demo.add_argument("--prompt-style", default="compact", choices=("json", "compact"),
                      help="how tools are listed in the system prompt (compact = shorter prompts)")
    demo.add_argument("--reward", default="binary",
                      help="reward name (binary, binary_match, fine, fine_stage1..3, ...)")
    demo.add_argument("--max-new-tokens", type=int, default=128,
                      help="generation budget per assistant message (tokens)")
    demo.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature; 0 = greedy decoding")
    demo.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (temperature > 0)")
    demo.add_argument("--max-steps", type=int, default=None,
                      help="assistant messages per multi-turn episode (default 8 per user turn)")
    demo.add_argument("--retries", type=int, default=None,
                      help="client retry budget: attempts per call (default: the client's policy)")
    demo.add_argument("--gold-replay", action=argparse.BooleanOptionalAction, default=True,
                      help="after the model's answer, also run the task's gold calls through the "
                           "same faulty tools (clearly labelled), so faults and retries show even "
                           "when a small model makes no call")
    demo.add_argument("--server-url", default=None,
                      help="tool server URL (from 'reflrl tools serve'); default: in-process")
    demo.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                      help="model precision on the CPU")

    check = env_sub.add_parser(
        "check", help="build each env id and run gymnasium's check_env",
        description="Build each registered env through gymnasium.make and run "
                    "gymnasium.utils.env_checker.check_env on it; prints OK per env.")
    check.add_argument("--id", dest="ids", action="append", default=None,
                       help="env id to check (repeatable; default: both reflrl ids)")
    check.add_argument("--faults", default="rate_limit=0.1,server_error=0.05",
                       help="fault spec the checked envs run with")
    check.add_argument("--seed", type=int, default=0, help="env seed")

    # ---- tools -------------------------------------------------------------------------
    tools = sub.add_parser("tools", help="the tool server", description="The tool server.")
    tools_sub = tools.add_subparsers(dest="tools_command", metavar="TOOLS_COMMAND")
    tools_sub.required = True
    serve = tools_sub.add_parser(
        "serve", help="serve the tool catalogue over HTTP on the loopback interface",
        description="Run the fault-injecting tool server (HTTP on 127.0.0.1) until interrupted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (loopback only: 127.0.0.1 or ::1)")
    serve.add_argument("--port", type=_port, default=8077, help="TCP port (0 = pick a free one)")
    serve.add_argument("--seed", type=int, default=0,
                       help="default data seed of episodes that do not give one")
    serve.add_argument("--sandbox-root", default=None,
                       help="folder for per-episode file sandboxes (default: a temporary folder)")
    serve.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn log level")

    # ---- faults ------------------------------------------------------------------------
    faults = sub.add_parser("faults", help="fault kinds", description="Fault kinds.")
    faults_sub = faults.add_subparsers(dest="faults_command", metavar="FAULTS_COMMAND")
    faults_sub.required = True
    flist = faults_sub.add_parser(
        "list", help="print the fault kinds: parameter, retried, what the client sees",
        description="Print the fault kinds table and the --faults spec grammar.")
    flist.add_argument("--width", type=int, default=110, help="table width in characters")
    proxy = faults_sub.add_parser(
        "proxy", help="a fault-injecting reverse proxy in front of any HTTP API",
        description="Forward every request to --upstream and inject the --faults plan's faults "
                    "(seeded and replayable: the decision is a pure function of seed, request "
                    "identity and attempt); GET /_reflrl/ledger lists the injected faults. "
                    "Binds the loopback interface.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    proxy.add_argument("--upstream", required=True,
                       help="base URL of the API to put the proxy in front of, e.g. "
                            "http://127.0.0.1:9000")
    proxy.add_argument("--faults", required=True, type=str,
                       help="fault spec kind=prob[:param],... (see 'reflrl faults list'); "
                            "invalid_file is for reflrl's file tools only")
    proxy.add_argument("--seed", type=int, default=0, help="fault seed")
    proxy.add_argument("--host", default="127.0.0.1",
                       help="address to bind (loopback only: 127.0.0.1, localhost or ::1)")
    proxy.add_argument("--port", type=int, default=8078, help="TCP port (0 = pick a free one)")
    proxy.add_argument("--max-body-bytes", type=int, default=1 << 20,
                       help="request bodies over this size are answered 413")
    proxy.add_argument("--upstream-timeout", type=float, default=60.0,
                       help="seconds to wait for the upstream before answering 504")

    # ---- train (the trainer parses its own arguments) ----------------------------------
    from reflrl.cli import train as train_cli  # 'reflrl train ...'
    train_cli.add_parser(sub)
    from .eval import add_eval_commands  # 'reflrl eval ...', 'reflrl data download ...'
    add_eval_commands(sub)
    from .experiment import add_experiment_commands  # 'reflrl experiment faults', 'reflrl report'
    add_experiment_commands(sub)
    return p


# ------------------------------------------------------------------------------- commands
def cmd_faults_list(args: argparse.Namespace) -> int:
    """Print the fault kinds table."""
    from reflrl.faults.kinds import format_kinds_table

    print(format_kinds_table(width=args.width))
    return 0


def cmd_env_check(args: argparse.Namespace) -> int:
    """gymnasium.make each env id and run check_env on the unwrapped env; OK/FAIL per env."""
    import contextlib
    import io
    import warnings

    import gymnasium
    from gymnasium.utils.env_checker import check_env

    import reflrl.envs

    _fault_spec(args.faults)
    ids = args.ids or list(reflrl.envs.ENV_IDS)
    failed = 0
    for env_id in ids:
        try:
            env = gymnasium.make(env_id, faults=args.faults, seed=args.seed)
        except gymnasium.error.Error as e:
            print(f"FAIL {env_id}: {e}")
            failed += 1
            continue
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    contextlib.redirect_stdout(io.StringIO()):  # render_mode="human" prints
                warnings.simplefilter("always")
                check_env(env.unwrapped)
            notes = sorted({str(w.message).splitlines()[0][:100] for w in caught})
            print(f"OK   {env_id}" + (f"  ({len(notes)} warning(s))" if notes else ""))
            for n in notes:
                print(f"       warning: {n}")
        except Exception as e:  # noqa: BLE001  report every env, then exit non-zero
            print(f"FAIL {env_id}: {type(e).__name__}: {e}")
            failed += 1
        finally:
            env.close()
    return 1 if failed else 0


def cmd_tools_serve(args: argparse.Namespace) -> int:
    """Run the tool server on the loopback interface until interrupted."""
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise UserError(f"--host {args.host!r}: the tool server binds the loopback interface only "
                         "(127.0.0.1, localhost or ::1)")
    from reflrl.envs import loopback as serve_mod

    try:
        serve_mod.serve(args.host, args.port, seed=args.seed, sandbox_root=args.sandbox_root,
                        log_level=args.log_level)
    except (OSError, OverflowError) as e:  # port in use, permission denied, ...
        raise UserError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    except KeyboardInterrupt:
        pass
    return 0


def cmd_faults_proxy(args: argparse.Namespace) -> int:
    """Run the fault proxy on the loopback interface until interrupted."""
    faults = _fault_spec(args.faults)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise UserError(f"--host {args.host!r}: the proxy binds the loopback interface only "
                         "(127.0.0.1, localhost or ::1)")
    from reflrl.envs import proxy as proxy_mod
    from reflrl.faults.spec import FaultSpecError

    try:
        proxy_mod.serve_proxy(args.upstream, faults, seed=args.seed, host=args.host,
                              port=args.port, max_body_bytes=args.max_body_bytes,
                              upstream_timeout=args.upstream_timeout)
    except (proxy_mod.ProxyError, FaultSpecError) as e:
        raise UserError(str(e)) from None
    except OSError as e:  # port in use, permission denied, ...
        raise UserError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    except KeyboardInterrupt:
        pass
    return 0


def cmd_env_demo(args: argparse.Namespace) -> int:
    """The episode demo (reflrl.demo)."""
    faults = _fault_spec(args.faults)
    if args.n_tasks < 1:
        raise UserError("--n-tasks must be at least 1")
    from reflrl import demo

    return int(demo.main_demo(args, faults=faults) or 0)


_COMMANDS = {
    ("faults", "list"): cmd_faults_list,
    ("faults", "proxy"): cmd_faults_proxy,
    ("env", "check"): cmd_env_check,
    ("env", "demo"): cmd_env_demo,
    ("tools", "serve"): cmd_tools_serve,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reflrl`` console script; returns the exit status."""
    from reflrl.threads import configure_process

    # before anything loads torch or starts a thread: waiting OpenMP threads sleep, oneDNN keeps a bounded
    # number of product shapes, the threads share few heap arenas (reflrl.threads)
    configure_process()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "func", None) is not None:  # train / eval / data / experiment carry their handler
            return int(args.func(args))
        sub = {"env": "env_command", "tools": "tools_command", "faults": "faults_command"}[args.command]
        return _COMMANDS[(args.command, getattr(args, sub))](args)
    except KeyboardInterrupt:
        print("reflrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. 'reflrl faults list | head': stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001  the one place errors become exit statuses
        return report_error(e, f"reflrl {args.command}")


def report_error(exc: Exception, prog: str = "reflrl") -> int:
    """Print ``exc`` for the user and return the exit status of its class (:func:`reflrl.errors.exit_code`):
    one line ``PROG: error: MESSAGE`` for reflrl's errors; the traceback and a request for a bug report
    for anything else."""
    from reflrl.errors import IncompleteRun, exit_code, message

    code = exit_code(exc)
    if code is None:
        import traceback

        traceback.print_exception(exc)
        print(BUG_REPORT, file=sys.stderr)
        return EXIT_BUG
    label = "note" if isinstance(exc, IncompleteRun) else "error"
    print(f"{prog}: {label}: {message(exc)}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
