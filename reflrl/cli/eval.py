"""argparse wiring of ``reflrl eval ...`` and ``reflrl data download ...`` (imports stay lazy: building
the parser loads neither torch nor bfcl)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from reflrl.errors import UserError

BENCH_CHOICES = ("rotbench", "taskbench", "bfcl", "sealtools")


def add_eval_commands(subparsers: Any) -> None:
    """Add ``eval`` and ``data`` to the ``reflrl`` subparsers (each sets ``func``)."""
    ev = subparsers.add_parser(
        "eval", help="score a model on RoTBench / TaskBench / BFCL / Seal-Tools, or compare two runs",
        description="reflrl eval BENCH [BENCH ...] (rotbench taskbench bfcl sealtools) scores a model "
                    "with the benchmarks' own metrics over several seeds and writes results.json, "
                    "manifest.json, report.md and predictions.jsonl. "
                    "'reflrl eval compare RUN_A RUN_B' compares two such runs against seed noise.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("targets", nargs="+", metavar="BENCH",
                    help="benchmarks to run (rotbench taskbench bfcl sealtools), or: compare RUN_A RUN_B")
    src = ev.add_argument_group("model (one of)")
    src.add_argument("--model", default=None,
                     help="registry name (smollm2-135m-instruct, tiny-random), HF id, model folder, or a "
                          "'reflrl train' run folder (its final checkpoint); with --endpoint: the served "
                          "model name")
    src.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    src.add_argument("--run", default=None, help="a reflrl run folder: evaluate its final (latest) checkpoint "
                                                 "(the same as --model RUN_DIR)")
    src.add_argument("--api-key", default=None, help="endpoint API key (default: $OPENAI_API_KEY or 'EMPTY')")
    ev.add_argument("--data-dir", default=os.environ.get("REFLRL_BENCH_DATA"),
                    help="folder with rotbench/, taskbench/, seal-tools/ (default $REFLRL_BENCH_DATA); "
                         "BFCL data comes from the bfcl-eval package")
    ev.add_argument("--limit", type=int, default=None,
                    help="first N samples of each subset (level / category / domain / split)")
    ev.add_argument("--seeds", type=int, default=3, help="number of seeds (0..K-1); results are mean ± std")
    ev.add_argument("--categories", default=None,
                    help="BFCL categories or groups, comma-separated (simple,multiple,parallel,"
                         "parallel_multiple,live_simple,...,multi_turn_base; groups non_live, live, "
                         "multi_turn, all); default: the Non-Live and Live python AST categories")
    ev.add_argument("--levels", default=None, help="RoTBench levels (clean,slight,medium,heavy,union)")
    ev.add_argument("--domains", default=None, help="TaskBench domains (huggingface,multimedia,dailylifeapis)")
    ev.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy (one seed)")
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    ev.add_argument("--max-new-tokens", type=int, default=256, help="generation budget per model answer")
    ev.add_argument("--template", default="native", choices=("native", "context"),
                    help="multi-turn history: role messages (native) or packed into one user turn (context)")
    ev.add_argument("--keep-thinking", action=argparse.BooleanOptionalAction, default=True,
                    help="keep <think> blocks of earlier assistant messages in multi-turn history")
    ev.add_argument("--max-steps", type=int, default=20, help="BFCL multi-turn steps per turn before force-quit")
    ev.add_argument("--out", default=None, help="output folder (default runs/eval/<time>-<model>)")
    ev.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="local model precision; auto: bfloat16 only where the CPU computes it natively (reflrl.precision)")
    ev.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (local model)")
    ev.add_argument("--concurrency", type=int, default=4, help="parallel requests (endpoint)")
    ev.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads for a local model (default: torch's; 1 is often fastest "
                         "when other jobs share the CPU)")
    ev.set_defaults(func=cmd_eval)

    data = subparsers.add_parser("data", help="benchmark data (download)", description="Benchmark data.")
    dsub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    dsub.required = True
    dl = dsub.add_parser("download", help="download a benchmark's files",
                         description="Download RoTBench's first-turn files into DEST/rotbench/first_turn/.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    dl.add_argument("benchmark", choices=("rotbench",), help="benchmark to download")
    dl.add_argument("--dest", required=True, help="destination folder (use it as --data-dir)")
    from reflrl.eval.download import ROTBENCH_URL

    dl.add_argument("--base-url", default=ROTBENCH_URL, help="folder URL holding <level>.json")
    dl.set_defaults(func=cmd_download)


def _split(s: str | None) -> list[str] | None:
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def cmd_eval(args: argparse.Namespace) -> int:
    if args.targets[0] == "compare":
        if len(args.targets) != 3:
            raise UserError("usage: reflrl eval compare RUN_A RUN_B")
        from reflrl.eval.compare import compare, format_comparison, load_result

        c = compare(load_result(args.targets[1]), load_result(args.targets[2]))
        print(format_comparison(c))
        return 0
    bad = [t for t in args.targets if t not in BENCH_CHOICES]
    if bad:
        raise UserError(f"unknown benchmark(s) {bad}; choose from {', '.join(BENCH_CHOICES)} (or 'compare')")
    if args.seeds < 1:
        raise UserError("--seeds must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    if sum(x is not None for x in (args.endpoint, args.run)) > 1 or (args.run and args.model):
        raise UserError("give exactly one of --model NAME, --endpoint URL --model NAME, --run RUN_DIR")
    from reflrl.eval.backends import Decoding, make_backend
    from reflrl.eval.run import EvalOptions, default_out_dir, run_eval

    if "bfcl" in args.targets:
        from reflrl.eval.bfcl import resolve_categories

        resolve_categories(args.categories)  # fail on a typo before loading the model
    opts = EvalOptions(
        benchmarks=list(dict.fromkeys(args.targets)),
        data_dir=Path(args.data_dir) if args.data_dir else None, limit=args.limit,
        seeds=list(range(args.seeds)),
        decoding=Decoding(args.temperature, args.top_p, args.max_new_tokens), template=args.template,
        keep_thinking=args.keep_thinking, max_steps=args.max_steps, categories=_split(args.categories),
        levels=_split(args.levels), domains=_split(args.domains))
    need_data = [b for b in opts.benchmarks if b != "bfcl"]
    if need_data and opts.data_dir is None:
        raise UserError(f"{', '.join(need_data)} need --data-dir (or $REFLRL_BENCH_DATA)")
    backend = make_backend(model=args.model, endpoint=args.endpoint, run=args.run, dtype=args.dtype,
                           batch_size=args.batch_size, api_key=args.api_key, concurrency=args.concurrency,
                           threads=args.threads)
    out_dir = Path(args.out) if args.out else default_out_dir(args.model or args.run or "model")
    result = run_eval(backend, opts, out_dir=out_dir, log=lambda m: print(m, file=sys.stderr))
    from reflrl.eval.tables import markdown_report

    print(markdown_report(result))
    print(f"wrote {out_dir}/results.json, manifest.json, report.md, predictions.jsonl")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from reflrl.eval.data import DataError
    from reflrl.eval.download import download_rotbench

    try:
        download_rotbench(args.dest, args.base_url)
    except OSError as e:  # the destination cannot be written
        raise DataError(f"--dest {args.dest}: {e}") from None
    return 0

