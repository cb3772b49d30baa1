"""Run benchmarks over seeds with one backend and write results.json, manifest.json, report.md and
predictions.jsonl (the reproducibility protocol of the efficiency paper (arXiv:2606.00135) sec. 3).

A benchmark is split into *units* (a RoTBench noise level, a BFCL category, a TaskBench domain, a
Seal-Tools split). Every sample is an *episode*: a generator that yields chat messages and receives
the model's text (single-turn samples yield once; BFCL multi-turn entries yield once per step). For
each seed and benchmark all episodes of its units advance together, in chunks of a few backend
batches (so the backend sees full batches and the progress lines move).

:func:`prepare` finds the data (``--data-dir``, else the shipped files and the cache,
:mod:`reflrl.eval.sources`), builds the units and the run plan (:mod:`reflrl.eval.plan`: samples x
seeds and the time estimate) before any model is loaded; :func:`run_eval` runs them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

from . import bfcl as bfcl_mod
from . import rotbench, sealtools, sources, taskbench
from .backends import Backend, Decoding, apply_template
from .data import DataError, check_lengths
from .manifest import build_manifest, data_hashes, prompt_record
from .plan import SECONDS_PER_SAMPLE, RunPlan, UnitSize

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
    available: int | None = None  # samples in the data (None: the data is itself an excerpt)

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
    #: per benchmark: samples per subset (None: all); a benchmark not named here uses ``limit``
    limits: dict[str, int | None] | None = None
    #: per benchmark: its seeds; a benchmark not named here uses ``seeds``
    seeds_by_benchmark: dict[str, list[int]] | None = None
    #: what the run size is called in the printout and the manifest: subset | full | custom
    mode: str = "custom"
    #: data roots when ``data_dir`` is None ({"rotbench": .., "sealtools": .., "taskbench/<domain>": ..});
    #: None: found by :func:`reflrl.eval.sources.roots_for` (shipped files, cache, download)
    data_roots: dict[str, Path] | None = None
    #: progress lines / bars on stderr
    progress: bool = True
    #: prompts per backend call (progress moves after each); None: 2 backend batches, at least 8
    chunk: int | None = None

    def limit_for(self, benchmark: str) -> int | None:
        if self.limits is not None and benchmark in self.limits:
            return self.limits[benchmark]
        return self.limit

    def seeds_for(self, benchmark: str) -> list[int]:
        if self.seeds_by_benchmark is not None and benchmark in self.seeds_by_benchmark:
            return list(self.seeds_by_benchmark[benchmark])
        return list(self.seeds)

    def root(self, key: str) -> Path:
        """The data root of ``key`` ("rotbench", "sealtools", "taskbench/<domain>"): ``data_dir`` when
        given (it overrides everything), else ``data_roots``."""
        if self.data_dir is not None:
            return Path(self.data_dir)
        roots = self.data_roots or {}
        for k in (key, key.split("/")[0]):
            if k in roots:
                return Path(roots[k])
        raise DataError(f"{key}: no data found; pass --data-dir\n{sources.DATA_DIR_LAYOUT}")


# --------------------------------------------------------------------------------- unit makers
def rotbench_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    root = opts.root("rotbench")
    limit = opts.limit_for("rotbench")
    units = []
    for lv in opts.levels or list(rotbench.LEVELS):
        every = rotbench.load_level(root, lv)  # every record is checked, not only the ones run
        items = every[:limit] if limit is not None else every
        units.append(Unit("rotbench", lv, [i.id for i in items],
                          (lambda items=items: [single(i.messages) for i in items]),
                          (lambda outs, items=items: rotbench.score(items, outs)),
                          [_sys(i.messages) for i in items], rotbench.data_files(root, [lv]),
                          available=len(every)))
    return units, []


def taskbench_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    units, skipped = [], []
    limit = opts.limit_for("taskbench")
    for dom in opts.domains or list(taskbench.DOMAINS):
        root = opts.root(f"taskbench/{dom}")
        td = taskbench.load_tool_desc(root, dom)
        gold = taskbench.gold_file(root, dom)
        if gold is None:
            skipped.append({"unit": f"taskbench/{dom}", "reason":
                            f"no data.json (gold task graphs) in {taskbench.domain_dir(root, dom)}"})
            continue
        every = taskbench.load_domain(root, dom)  # every record is checked, not only the ones run
        items = every[:limit] if limit is not None else every
        excerpt = Path(root).resolve() == sources.package_root().resolve()
        template = taskbench.prompt_template(td, dom)
        msgs = [taskbench.prompt_messages(i, td, dom, template) for i in items]
        units.append(Unit("taskbench", dom, [i.id for i in items],
                          (lambda msgs=msgs: [single(m) for m in msgs]),
                          (lambda outs, items=items, td=td, dom=dom: taskbench.score(items, outs, td, dom)),
                          [],  # no system message: the template below is the whole prompt
                          [gold, taskbench.domain_dir(root, dom) / "tool_desc.json"],
                          prompt_template=template, available=None if excerpt else len(every)))
    return units, skipped


def sealtools_units(opts: EvalOptions) -> tuple[list[Unit], list[dict[str, str]]]:
    root = opts.root("sealtools")
    limit = opts.limit_for("sealtools")
    tools = sealtools.load_tools(root)
    units = []
    tool_file = sealtools.tool_file(root)
    for path in sealtools.split_files(root):
        every = sealtools.load_split(path, tools)  # every record is checked, not only the ones run
        items = every[:limit] if limit is not None else every
        units.append(Unit("sealtools", sealtools.SPLIT_NAMES[path.name], [i.id for i in items],
                          (lambda items=items: [single(i.messages) for i in items]),
                          (lambda outs, items=items: sealtools.score(items, outs)),
                          [_sys(i.messages) for i in items], [path, tool_file], available=len(every)))
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
    limit = opts.limit_for("bfcl")
    for cat in cats:
        every = bfcl_mod.load_entries(cat)
        entries = every[:limit] if limit is not None else every
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
                          prompts, bfcl_mod.data_files([cat]), prompt_template=template,
                          available=len(every)))
    return units, []


MAKERS = {"rotbench": rotbench_units, "taskbench": taskbench_units, "bfcl": bfcl_units,
          "sealtools": sealtools_units}


# ---------------------------------------------------------------------------------- the driver
def drive(backend: Backend, episodes: list[Generator], decoding: Decoding, seed: int, template: str,
          desc: str = "", errors: list[str] | None = None, chunk: int | None = None,
          on_done: Callable[[int], None] | None = None) -> list[Any]:
    """Advance all episodes together: each round, the episodes waiting for a model answer go to
    ``backend.chat``, ``chunk`` at a time, shortest prompts first (all at once when None; each call gets
    its own seed, fixed by ``seed``, the round and the chunk's index). ``on_done(n)`` is told each time ``n`` more episodes
    finished. Returns each episode's return value, in order. An episode that raises returns None
    (scored wrong by every scorer) and its error is appended to ``errors``."""
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
    finished = len(episodes) - len(pending)
    if on_done is not None and finished:
        on_done(finished)
    rnd = 0
    while pending:
        waiting = list(pending)
        if chunk is not None:  # similar lengths decode together, as one call would sort them
            waiting.sort(key=lambda i: sum(len(str(m.get("content", ""))) for m in pending[i]))
        step = chunk or len(waiting)
        for c, start in enumerate(range(0, len(waiting), step)):
            idx = waiting[start: start + step]
            convs = [apply_template(pending[i], template) for i in idx]
            label = f"{desc} round {rnd + 1}" if desc and rnd else desc
            call_seed = seed * 1009 + rnd if chunk is None else (seed * 1009 + rnd) * 100_003 + c
            outs = backend.chat(convs, decoding, call_seed, desc=label)
            if len(outs) != len(idx):
                raise RuntimeError(f"backend returned {len(outs)} completions for {len(idx)} prompts")
            for i, text in zip(idx, outs):
                advance(i, text)
            now = len(episodes) - len(pending)
            if on_done is not None and now > finished:
                on_done(now - finished)
            finished = now
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
    """Labels for the manifest's data file names (:func:`reflrl.eval.manifest.data_key`)."""
    roots: dict[str, Path] = {}
    if opts.data_dir is not None:
        roots["data-dir"] = Path(opts.data_dir)
    roots["reflrl/benchdata"] = sources.package_root()
    roots["cache/benchdata"] = sources.cache_dir()
    if "bfcl" in opts.benchmarks:
        roots["bfcl_eval/data"] = bfcl_mod.bfcl().package_root
    return roots


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-")[:60] or "model"


def default_out_dir(model_name: str) -> Path:
    return Path("runs") / "eval" / f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(Path(model_name).name)}"


@dataclass
class Prepared:
    """A run ready to start: its options (data roots filled in), units, seeds per benchmark and plan."""

    opts: EvalOptions
    units: list[Unit]
    skipped: list[dict[str, str]]
    seeds: dict[str, list[int]]
    plan: RunPlan
    notes: list[str]


def prepare(opts: EvalOptions, log: Callable[[str], None] = print) -> Prepared:
    """Find the data (downloading what is not shipped, once), load and check it, and size the run;
    loads no model. DataError / ValueError name what is wrong."""
    for b in opts.benchmarks:
        if b not in MAKERS:
            raise DataError(f"unknown benchmark {b!r}; expected some of {', '.join(BENCHMARKS)}")
    need = [b for b in opts.benchmarks if b != "bfcl"]
    if opts.data_dir is None and opts.data_roots is None and need:
        roots = sources.roots_for(need, limits={b: opts.limit_for(b) for b in need}, domains=opts.domains, log=log)
        opts = dataclasses.replace(opts, data_roots=roots)
    notes: list[str] = []
    seeds = {b: opts.seeds_for(b) for b in opts.benchmarks}
    if opts.decoding.greedy and any(len(v) > 1 for v in seeds.values()):
        notes.append("greedy decoding gives the same output for every seed: ran the first seed only")
        seeds = {b: v[:1] for b, v in seeds.items()}
    units: list[Unit] = []
    skipped: list[dict[str, str]] = []
    for b in opts.benchmarks:
        u, sk = MAKERS[b](opts)
        units.extend(u)
        skipped.extend(sk)
    plan = RunPlan(mode=opts.mode,
                   units={b: [UnitSize(u.key, len(u.ids), u.available) for u in units if u.benchmark == b]
                          for b in opts.benchmarks},
                   seeds={b: len(seeds[b]) for b in opts.benchmarks})
    return Prepared(opts, units, skipped, seeds, plan, notes)


def run_eval(backend: Backend, opts: EvalOptions, out_dir: Path | None = None,
             log: Callable[[str], None] = print, prepared: Prepared | None = None) -> dict[str, Any]:
    """Evaluate ``backend`` on ``opts.benchmarks`` for each seed; write the four output files into
    ``out_dir`` (when given) and return the results dict. ``prepared``: from :func:`prepare` (made
    here when None)."""
    from reflrl.progress import Progress, clock_text

    prep = prepared or prepare(opts, log)
    opts, units, skipped, seeds = prep.opts, prep.units, prep.skipped, prep.seeds
    notes = list(prep.notes)
    for s in skipped:
        log(f"[reflrl eval] skipped {s['unit']}: {s['reason']}")
    all_seeds = sorted({k for v in seeds.values() for k in v})
    prompts = {u.key: prompt_record(u.system_prompts, u.prompt_template) for u in units}
    files = sorted({p for u in units for p in u.files}, key=str)
    manifest = build_manifest(
        model=backend.describe(), seeds=all_seeds, decoding=opts.decoding.to_dict(), template=opts.template,
        keep_thinking=opts.keep_thinking, max_steps=opts.max_steps, benchmarks=opts.benchmarks,
        limit={b: opts.limit_for(b) for b in opts.benchmarks}, options={
            "bfcl_categories": [u.name for u in units if u.benchmark == "bfcl"],
            "rotbench_levels": [u.name for u in units if u.benchmark == "rotbench"],
            "taskbench_domains": [u.name for u in units if u.benchmark == "taskbench"],
            "sealtools_splits": [u.name for u in units if u.benchmark == "sealtools"]},
        prompts=prompts, data=data_hashes(files, _data_roots(opts)), out_dir=str(out_dir) if out_dir else None,
        data_dir=str(Path(opts.data_dir).resolve()) if opts.data_dir else None,
        seeds_per_benchmark=seeds, run_size=prep.plan.to_dict())
    per_unit: dict[str, list[dict[str, Any]]] = {u.key: [] for u in units}
    predictions: list[dict[str, Any]] = []
    phases = [(seed, b) for seed in all_seeds for b in opts.benchmarks
              if seed in seeds[b] and any(u.benchmark == b for u in units)]
    progress = Progress(enabled=opts.progress, stream=sys.stderr, every_s=30.0)
    timing: list[dict[str, Any]] = []
    chunk = opts.chunk or max(8, 2 * int(getattr(backend, "batch_size", 8) or 8))
    for k, (seed, bench) in enumerate(phases):
        t0 = time.perf_counter()
        eps: list[Generator] = []
        spans = []
        for u in units:
            if u.benchmark != bench:
                continue
            e = u.episodes()
            spans.append((u, len(eps), len(eps) + len(e)))
            eps.extend(e)
        phase = progress.phase(f"{bench} seed {seed}", len(eps), unit="sample")

        def later(phase=phase, bench=bench, k=k) -> float | None:
            """Planned seconds of the phases after this one, at this phase's measured pace."""
            sps = phase.seconds_per_step()
            if sps is None:
                return None
            scale = sps / SECONDS_PER_SAMPLE.get(bench, 4.0)
            rest = phases[k + 1:]
            return scale * sum(SECONDS_PER_SAMPLE.get(b, 4.0) * prep.plan.samples(b) for _, b in rest)

        progress.remaining_after = later

        def on_done(n: int, phase=phase, later=later) -> None:
            phase.update(n)
            if phase.bar is not None:  # a terminal: the bar shows the phase's ETA, add the run's
                eta, rest = phase.eta_s(), later()
                if eta is not None and rest is not None:
                    phase.bar.set_postfix_str(f"run ends in ~{clock_text(eta + rest)}")

        errs: list[str] = []
        outs = drive(backend, eps, opts.decoding, seed, opts.template, errors=errs, chunk=chunk, on_done=on_done)
        if errs:
            notes.append(f"{bench} seed {seed}: {len(errs)} episode(s) failed and were scored wrong: {errs[:5]}")
        for u, a, b in spans:
            metrics, per = u.score(outs[a:b])
            per_unit[u.key].append(metrics)
            for sample, out in zip(per, outs[a:b]):
                predictions.append({"seed": seed, "benchmark": u.benchmark, "unit": u.name, "output": out, **sample})
        took = time.perf_counter() - t0
        phase.close()
        timing.append({"benchmark": bench, "seed": seed, "samples": len(eps), "seconds": round(took, 2)})
        if not opts.progress:
            log(f"[reflrl eval] {bench} seed {seed}: {len(eps)} samples in {took:.1f}s")
    results: dict[str, Any] = {}
    for u in units:
        results.setdefault(u.benchmark, {})[u.name] = _aggregate(per_unit[u.key])
    if "bfcl" in results:
        bunits = [u for u in units if u.benchmark == "bfcl"]
        summ = []
        for k in range(len(seeds["bfcl"])):
            acc = {u.name: per_unit[u.key][k]["accuracy"] / 100 for u in bunits}
            cnt = {u.name: per_unit[u.key][k]["n"] for u in bunits}
            s = bfcl_mod.summarize(acc, cnt)
            summ.append({g: (None if s[g] is None else 100 * s[g]) for g in
                         ("non_live", "live", "irrelevance", "multi_turn", "overall")})
        results["bfcl_summary"] = _aggregate(summ)
        results["bfcl_summary"]["groups_used"] = bfcl_mod.summarize(
            {u.name: 0.0 for u in bunits}, {u.name: 1 for u in bunits})["groups_used"]
    per_seed = [sum(t["seconds"] for t in timing if t["seed"] == sd) for sd in all_seeds]
    rates = {}
    for b in opts.benchmarks:
        n = sum(t["samples"] for t in timing if t["benchmark"] == b)
        if n:
            rates[b] = round(sum(t["seconds"] for t in timing if t["benchmark"] == b) / n, 3)
    from .paper import summary as paper_summary

    out = {"kind": "reflrl-eval-results", "format": 1, "manifest": manifest, "results": results,
           "skipped": skipped, "notes": notes,
           "timing": {"seconds_per_seed": per_seed, "phases": timing, "seconds_per_sample": rates,
                      "estimate_s": prep.plan.to_dict()["estimate_s"]},
           "backend_stats": dict(getattr(backend, "stats", {}) or {}),
           "paper_reference": paper_summary()}
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
