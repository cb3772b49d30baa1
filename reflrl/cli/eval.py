"""argparse wiring of ``reflrl eval ...``, ``reflrl data download ...`` and ``reflrl data list``
(imports stay lazy: building the parser loads neither torch nor bfcl)."""
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
                    "manifest.json, report.md and predictions.jsonl. The data ships with reflrl (TaskBench's "
                    "whole files are downloaded once when a run needs them). By default it runs a fixed "
                    "subset sized for about 20 minutes on 2 CPU cores (the first samples of every subset) "
                    "and says so; --full runs everything. "
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
                    help="read every benchmark from this folder instead of the shipped data: "
                         "rotbench/first_turn/<level>.json, taskbench/data_<domain>/{data,tool_desc}.json, "
                         "seal-tools/{test_in_domain,test_out_domain,tool}.jsonl (default "
                         "$REFLRL_BENCH_DATA); BFCL's data comes with the bfcl-eval package")
    from reflrl.eval.plan import DEFAULT_LIMIT, DEFAULT_SEEDS, FULL_SEEDS

    ev.add_argument("--limit", default=argparse.SUPPRESS,
                    help="first N samples of each subset (level / category / domain / split): N for every "
                         "benchmark or bench=N,... (default, a subset: "
                         f"{','.join(f'{b}={n}' for b, n in DEFAULT_LIMIT.items())})")
    ev.add_argument("--seeds", default=argparse.SUPPRESS,
                    help="number of seeds (0..K-1), K or bench=K,...; results are mean ± std (default: "
                         f"{','.join(f'{b}={n}' for b, n in DEFAULT_SEEDS.items())}; {FULL_SEEDS} with --full)")
    ev.add_argument("--full", action="store_true",
                    help="every sample of every subset (hours on a CPU; TaskBench's whole files are "
                         "downloaded once)")
    ev.add_argument("--dry-run", action="store_true",
                    help="print the run's size and time estimate, then stop (loads no model)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars / lines")
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
                    help="local model precision; auto: the faster of bfloat16 and float32 on this CPU (reflrl.precision)")
    ev.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (local model)")
    ev.add_argument("--concurrency", type=int, default=4, help="parallel requests (endpoint)")
    ev.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads for a local model (default: torch's; 1 is often fastest "
                         "when other jobs share the CPU)")
    ev.set_defaults(func=cmd_eval)

    data = subparsers.add_parser("data", help="benchmark data (list, download)",
                                 description="The benchmark data reflrl ships and downloads.")
    dsub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    dsub.required = True
    dl = dsub.add_parser("download", help="download a benchmark's whole upstream files",
                         description="Download a benchmark's whole files from their pinned upstream commit, "
                                     "each checked against its pinned hash and every record validated. "
                                     "Without --dest: TaskBench's whole data.json files into the cache, so "
                                     "later --full runs need no network. With --dest DIR: the files in the "
                                     "--data-dir layout under DIR.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    dl.add_argument("benchmark", choices=("rotbench", "taskbench", "sealtools"), help="benchmark to download")
    dl.add_argument("--dest", default=None, help="a folder to use as --data-dir (default for taskbench: the cache)")
    dl.add_argument("--domains", default=None, help="TaskBench domains (huggingface,multimedia,dailylifeapis)")
    dl.add_argument("--base-url", default=None,
                    help="mirror of raw.githubusercontent.com (<owner>/<repo>/<commit>/<path>); default "
                         "$REFLRL_BENCHDATA_URL or https://raw.githubusercontent.com")
    dl.set_defaults(func=cmd_download)
    ls = dsub.add_parser("list", help="what is shipped, cached or downloaded on first use, and where from",
                         description="Every benchmark data file reflrl knows: shipped with the package, "
                                     "cached, or downloaded on first use; its upstream commit and licence.")
    ls.set_defaults(func=cmd_data_list)


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
    if sum(x is not None for x in (args.endpoint, args.run)) > 1 or (args.run and args.model):
        raise UserError("give exactly one of --model NAME, --endpoint URL --model NAME, --run RUN_DIR")
    import time

    from reflrl.eval.backends import Decoding, make_backend
    from reflrl.eval.plan import sizes
    from reflrl.eval.run import EvalOptions, default_out_dir, prepare, run_eval
    from reflrl.progress import clock_text

    t_start = time.monotonic()
    benchmarks = list(dict.fromkeys(args.targets))
    try:
        limits, nseeds, mode = sizes(benchmarks, limit=getattr(args, "limit", None),
                                     seeds=getattr(args, "seeds", None), full=args.full)
    except ValueError as e:
        raise UserError(str(e)) from None
    if "bfcl" in benchmarks:
        from reflrl.eval.bfcl import resolve_categories

        resolve_categories(args.categories)  # fail on a typo before loading the model
    if not args.dry_run and not (args.model or args.endpoint or args.run):
        raise UserError("give --model NAME, --endpoint URL --model NAME, or --run RUN_DIR")
    opts = EvalOptions(
        benchmarks=benchmarks, data_dir=Path(args.data_dir) if args.data_dir else None,
        limits=limits, seeds=list(range(max(nseeds.values()))),
        seeds_by_benchmark={b: list(range(n)) for b, n in nseeds.items()}, mode=mode,
        decoding=Decoding(args.temperature, args.top_p, args.max_new_tokens), template=args.template,
        keep_thinking=args.keep_thinking, max_steps=args.max_steps, categories=_split(args.categories),
        levels=_split(args.levels), domains=_split(args.domains), progress=not args.no_progress)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    prepared = prepare(opts, log=log)
    log(prepared.plan.text())
    if args.dry_run:
        return 0
    backend = make_backend(model=args.model, endpoint=args.endpoint, run=args.run, dtype=args.dtype,
                           batch_size=args.batch_size, api_key=args.api_key, concurrency=args.concurrency,
                           threads=args.threads)
    out_dir = Path(args.out) if args.out else default_out_dir(args.model or args.run or "model")
    result = run_eval(backend, opts, out_dir=out_dir, log=log, prepared=prepared)
    from reflrl.eval.tables import markdown_report

    print(markdown_report(result))
    print(f"wrote {out_dir}/results.json, manifest.json, report.md, predictions.jsonl")
    log(f"[reflrl eval] took {clock_text(time.monotonic() - t_start)} "
        f"(estimated {clock_text(prepared.plan.estimate_s())})")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from reflrl.eval import sources
    from reflrl.eval.data import DataError
    from reflrl.eval.taskbench import DOMAINS

    domains = _split(args.domains) or list(DOMAINS)
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise UserError(f"--domains: unknown TaskBench domain(s) {unknown}; expected {', '.join(DOMAINS)}")
    try:
        if args.dest is None:
            if args.benchmark != "taskbench":
                raise UserError(f"{args.benchmark} ships whole with reflrl; give --dest DIR to download "
                                "upstream's files into a --data-dir folder")
            for dom in domains:
                sources.ensure_taskbench_full(dom, base_url=args.base_url)
        else:
            sources.download(args.benchmark, Path(args.dest), base_url=args.base_url,
                             domains=domains if args.benchmark == "taskbench" else None)
    except OSError as e:  # the destination cannot be written
        raise DataError(f"cannot write the data: {e}") from None
    return 0


def cmd_data_list(args: argparse.Namespace) -> int:
    from reflrl.eval import sources

    for r in sources.cached_or_shipped():
        rec = f"{r['records']} records" if r["records"] is not None else ""
        print(f"{r['layout']}  {r['status']}  {rec}  {r['repository']}@{r['commit'][:12]}:{r['path']} "
              f"({r['license']}; {r['part']})")
    print(f"shipped: {sources.package_root()}; cache: {sources.cache_dir()}")
    return 0
