"""Run benchmarks over seeds with one backend and write results.json, manifest.json, report.md and
predictions.jsonl (the reproducibility protocol of the efficiency paper (arXiv:2606.00135) sec. 3).

A benchmark is split into *units* (a RoTBench noise level, a BFCL category, a TaskBench domain, a
Seal-Tools split). Every sample is an *episode*: a generator that yields chat messages and receives
the model's text (single-turn samples yield once; BFCL multi-turn entries yield once per step). For
each seed all episodes of all units advance together, so the backend always sees full batches.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

from . import bfcl as bfcl_mod
from . import rotbench, sealtools, taskbench
from .backends import Backend, Decoding, apply_template
from .data import DataError, check_lengths
from .manifest import build_manifest, data_hashes, prompt_record

BENCHMARKS = ("rotbench", "taskbench", "bfcl", "sealtools")
DEFAULT_SEEDS = 3


@dataclass
class Unit:
    """One scored subset. ``episodes()`` makes fresh episodes (one per sample) for a seed;
    ``score(outputs)`` -> (metrics, per-sample verdicts)."""

    benchmark: str
    name: str
    ids: list[str]
    episodes: Callable[[], list[Generator]]
    score: Callable[[list[Any]], tuple[dict[str, Any], list[dict[str, Any]]]]
    system_prompts: list[str]
    files: list[Path]
    prompt_template: str | None = None

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.name}"


def single(messages: list[dict[str, Any]]) -> Generator:
    """A one-step episode: yields ``messages`` once, returns the model's text."""
    text = yield messages
    return text


def _sys(msgs: list[dict[str, Any]]) -> str:
    return msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else ""


@dataclass
class EvalOptions:
    """What to evaluate and how (everything here lands in the manifest)."""

    benchmarks: list[str]
    data_dir: Path | None = None
    limit: int | None = None
    seeds: list[int] = field(default_factory=lambda: list(range(DEFAULT_SEEDS)))
    decoding: Decoding = field(default_factory=Decoding)
    template: str = "native"
    keep_thinking: bool = True
    max_steps: int = bfcl_mod.MAX_STEPS
    categories: list[str] | None = None
    levels: list[str] | None = None
    domains: list[str] | None = None


# --------------------------------------------------------------------------------- unit makers
def rotbench_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    if opts.data_dir is None:
        raise DataError("rotbench needs --data-dir (a folder with rotbench/first_turn/<level>.json)")
    units = []
    for lv in opts.levels or list(rotbench.LEVELS):
        items = rotbench.load_level(opts.data_dir, lv, opts.limit)
        units.append(Unit("rotbench", lv, [i.id for i in items],
                          (lambda items=items: [single(i.messages) for i in items]),
                          (lambda outs, items=items: rotbench.score(items, outs)),
                          [_sys(i.messages) for i in items], rotbench.data_files(opts.data_dir, [lv])))
    return units, []


def taskbench_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    if opts.data_dir is None:
        raise DataError("taskbench needs --data-dir (a folder with taskbench/data_<domain>/)")
    units, skipped = [], []
    for dom in opts.domains or list(taskbench.DOMAINS):
        td = taskbench.load_tool_desc(opts.data_dir, dom)
        gold = taskbench.gold_file(opts.data_dir, dom)
        if gold is None:
            skipped.append({"unit": f"taskbench/{dom}", "reason":
                            f"no data.json (gold task graphs) in {taskbench.domain_dir(opts.data_dir, dom)}"})
            continue
        items = taskbench.load_domain(opts.data_dir, dom, opts.limit)
        template = taskbench.prompt_template(td, dom)
        msgs = [taskbench.prompt_messages(i, td, dom, template) for i in items]
        units.append(Unit("taskbench", dom, [i.id for i in items],
                          (lambda msgs=msgs: [single(m) for m in msgs]),
                          (lambda outs, items=items, td=td, dom=dom: taskbench.score(items, outs, td, dom)),
                          [],  # no system message: the template below is the whole prompt
                          [gold, taskbench.domain_dir(opts.data_dir, dom) / "tool_desc.json"],
                          prompt_template=template))
    return units, skipped


def sealtools_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    if opts.data_dir is None:
        raise DataError("sealtools needs --data-dir (a folder with seal-tools/*.jsonl)")
    tools = sealtools.load_tools(opts.data_dir)
    units = []
    d = sealtools.seal_dir(opts.data_dir)
    tool_file = next(p for p in (d / "tool.jsonl", d / "tool_subset.jsonl") if p.exists())
    for path in sealtools.split_files(opts.data_dir):
        items = sealtools.load_split(path, tools, opts.limit)
        units.append(Unit("sealtools", sealtools.SPLIT_NAMES[path.name], [i.id for i in items],
                          (lambda items=items: [single(i.messages) for i in items]),
                          (lambda outs, items=items: sealtools.score(items, outs)),
                          [_sys(i.messages) for i in items], [path, tool_file]))
    return units, []


def _bfcl_score(entries: list[bfcl_mod.BfclEntry], outs: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    check_lengths("bfcl", entries, outs)
    per = []
    for e, out in zip(entries, outs):
        v = bfcl_mod.score_multi_turn(e, out) if e.multi_turn else bfcl_mod.score_single(e, out)
        per.append({"id": e.id, **{k: v.get(k) for k in ("valid", "error_type", "error", "unevaluated")}})
    n = len(per)
    return {"accuracy": 100.0 * sum(p["valid"] for p in per) / n if n else 0.0, "n": n,
            "unevaluated_outputs": sum(bool(p.get("unevaluated")) for p in per),
            "unevaluated_ids": [p["id"] for p in per if p.get("unevaluated")]}, per


def bfcl_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    cats = bfcl_mod.resolve_categories(opts.categories)
    template = bfcl_mod.system_prompt_template()
    units = []
    for cat in cats:
        entries = bfcl_mod.load_entries(cat, opts.limit)
        if cat in bfcl_mod.MULTI_TURN:
            make = (lambda entries=entries: [bfcl_mod.multi_turn_episode(
                e, max_steps=opts.max_steps, keep_thinking=opts.keep_thinking) for e in entries])
            prompts = []
        else:
            msgs = [bfcl_mod.single_turn_messages(e) for e in entries]
            make = (lambda msgs=msgs: [single(m) for m in msgs])
            prompts = [_sys(m) for m in msgs]
        units.append(Unit("bfcl", cat, [e.id for e in entries], make,
                          (lambda outs, entries=entries: _bfcl_score(entries, outs)),
                          prompts, bfcl_mod.data_files([cat]), prompt_template=template))
    return units, []


MAKERS = {"rotbench": rotbench_units, "taskbench": taskbench_units, "bfcl": bfcl_units,
          "sealtools": sealtools_units}


# ---------------------------------------------------------------------------------- the driver
def drive(backend: Backend, episodes: list[Generator], decoding: Decoding, seed: int, template: str,
          desc: str = "", errors: list[str] | None = None) -> list[Any]:
    """Advance all episodes together: each round, every episode waiting for a model answer goes into
    one ``backend.chat`` call. Returns each episode's return value, in order. An episode that raises
    returns None (scored wrong by every scorer) and its error is appended to ``errors``."""
    results: list[Any] = [None] * len(episodes)
    pending: dict[int, list[dict[str, Any]]] = {}

    def advance(i: int, value: Any, first: bool = False) -> None:
        try:
            pending[i] = next(episodes[i]) if first else episodes[i].send(value)
        except StopIteration as s:
            results[i] = s.value
            pending.pop(i, None)
        except Exception as e:  # noqa: BLE001  one broken episode must not abort the run
            pending.pop(i, None)
            if errors is not None:
                errors.append(f"episode {i}: {type(e).__name__}: {e}"[:300])

    for i in range(len(episodes)):
        advance(i, None, first=True)
    rnd = 0
    while pending:
        idx = list(pending)
        convs = [apply_template(pending[i], template) for i in idx]
        label = f"{desc} round {rnd + 1}" if desc and rnd else desc
        outs = backend.chat(convs, decoding, seed * 1009 + rnd, desc=label)
        if len(outs) != len(idx):
            raise RuntimeError(f"backend returned {len(outs)} completions for {len(idx)} prompts")
        for i, text in zip(idx, outs):
            advance(i, text)
        rnd += 1
    return results


def mean_std(values: list[float | None]) -> dict[str, Any]:
    """``{"mean", "std", "values"}``; std is the sample standard deviation (0 for one value)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "values": values}
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": m, "std": sd, "values": values}


def _aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-seed metric dicts -> the same shape with numeric leaves replaced by mean/std/values."""
    first = per_seed[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, bool) or k == "n" or k.startswith("n_"):
            vals = [s.get(k) for s in per_seed]
            out[k] = v if all(x == v for x in vals) else vals  # counts that vary by seed: one per seed
        elif isinstance(v, (int, float)) or v is None and all(
                isinstance(s.get(k), (int, float, type(None))) for s in per_seed):
            out[k] = mean_std([s.get(k) for s in per_seed])
        elif isinstance(v, dict) and k != "counts":
            out[k] = _aggregate([s[k] for s in per_seed])
        else:
            out[k] = [s.get(k) for s in per_seed] if len(per_seed) > 1 else v
    return out


def _data_roots(opts: EvalOptions) -> dict[str, Path]:
    roots: dict[str, Path] = {}
    if opts.data_dir is not None:
        roots["data-dir"] = Path(opts.data_dir)
    if "bfcl" in opts.benchmarks:
        roots["bfcl_eval/data"] = bfcl_mod.bfcl().package_root
    return roots


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-")[:60] or "model"


def default_out_dir(model_name: str) -> Path:
    return Path("runs") / "eval" / f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(Path(model_name).name)}"


def run_eval(backend: Backend, opts: EvalOptions, out_dir: Path | None = None,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate ``backend`` on ``opts.benchmarks`` for each seed; write the four output files into
    ``out_dir`` (when given) and return the results dict."""
    for b in opts.benchmarks:
        if b not in MAKERS:
            raise DataError(f"unknown benchmark {b!r}; expected some of {', '.join(BENCHMARKS)}")
    seeds = list(opts.seeds)
    notes = []
    if opts.decoding.greedy and len(seeds) > 1:
        notes.append(f"greedy decoding gives the same output for every seed: ran seed {seeds[0]} only")
        seeds = seeds[:1]
    units: list[Unit] = []
    skipped: list[dict[str, str]] = []
    for b in opts.benchmarks:
        u, s = MAKERS[b](opts)
        units.extend(u)
        skipped.extend(s)
    for s in skipped:
        log(f"[reflrl eval] skipped {s['unit']}: {s['reason']}")
    prompts = {u.key: prompt_record(u.system_prompts, u.prompt_template) for u in units}
    files = sorted({p for u in units for p in u.files}, key=str)
    manifest = build_manifest(
        model=backend.describe(), seeds=seeds, decoding=opts.decoding.to_dict(), template=opts.template,
        keep_thinking=opts.keep_thinking, max_steps=opts.max_steps, benchmarks=opts.benchmarks,
        limit=opts.limit, options={
            "bfcl_categories": [u.name for u in units if u.benchmark == "bfcl"],
            "rotbench_levels": [u.name for u in units if u.benchmark == "rotbench"],
            "taskbench_domains": [u.name for u in units if u.benchmark == "taskbench"],
            "sealtools_splits": [u.name for u in units if u.benchmark == "sealtools"]},
        prompts=prompts, data=data_hashes(files, _data_roots(opts)), out_dir=str(out_dir) if out_dir else None,
        data_dir=str(Path(opts.data_dir).resolve()) if opts.data_dir else None)
    per_unit: dict[str, list[dict[str, Any]]] = {u.key: [] for u in units}
    predictions: list[dict[str, Any]] = []
    seconds: list[float] = []
    for seed in seeds:
        t0 = time.perf_counter()
        eps: list[Generator] = []
        spans = []
        for u in units:
            e = u.episodes()
            spans.append((u, len(eps), len(eps) + len(e)))
            eps.extend(e)
        errs: list[str] = []
        outs = drive(backend, eps, opts.decoding, seed, opts.template, desc=f"seed {seed}", errors=errs)
        if errs:
            notes.append(f"seed {seed}: {len(errs)} episode(s) failed and were scored wrong: {errs[:5]}")
        for u, a, b in spans:
            metrics, per = u.score(outs[a:b])
            per_unit[u.key].append(metrics)
            for sample, out in zip(per, outs[a:b]):
                predictions.append({"seed": seed, "benchmark": u.benchmark, "unit": u.name, "output": out, **sample})
        seconds.append(time.perf_counter() - t0)
        log(f"[reflrl eval] seed {seed}: {len(eps)} samples in {seconds[-1]:.1f}s")
    results: dict[str, Any] = {}
    for u in units:
        results.setdefault(u.benchmark, {})[u.name] = _aggregate(per_unit[u.key])
    if "bfcl" in results:
        bunits = [u for u in units if u.benchmark == "bfcl"]
        summ = []
        for k in range(len(seeds)):
            acc = {u.name: per_unit[u.key][k]["accuracy"] / 100 for u in bunits}
            cnt = {u.name: per_unit[u.key][k]["n"] for u in bunits}
            s = bfcl_mod.summarize(acc, cnt)
            summ.append({g: (None if s[g] is None else 100 * s[g]) for g in
                         ("non_live", "live", "irrelevance", "multi_turn", "overall")})
        results["bfcl_summary"] = _aggregate(summ)
        results["bfcl_summary"]["groups_used"] = bfcl_mod.summarize(
            {u.name: 0.0 for u in bunits}, {u.name: 1 for u in bunits})["groups_used"]
    out = {"kind": "reflrl-eval-results", "format": 1, "manifest": manifest, "results": results,
           "skipped": skipped, "notes": notes, "timing": {"seconds_per_seed": seconds},
           "backend_stats": dict(getattr(backend, "stats", {}) or {})}
    if out_dir is not None:
        write_outputs(out, predictions, Path(out_dir))
    return out


def write_outputs(result: dict[str, Any], predictions: list[dict[str, Any]], out_dir: Path) -> None:
    from .tables import markdown_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").write_text(json.dumps(result["manifest"], indent=2, default=str) + "\n")
    (out_dir / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown_report(result))
    with open(out_dir / "predictions.jsonl", "w") as f:
        for p in predictions:
            f.write(json.dumps(p, default=str) + "\n")
