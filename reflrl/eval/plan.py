"""How big a ``reflrl eval`` run is and how long it should take, said before it starts.

The default run is a fixed subset sized so that RoTBench + TaskBench + BFCL finish in about 20 minutes
on 2 CPU cores with the embedded model (smollm2-135m-instruct): the first :data:`DEFAULT_LIMIT`
samples of every subset (level / domain / category / split) for :data:`DEFAULT_SEEDS` seeds.
``--full`` runs every sample (:data:`FULL_SEEDS` seeds); ``--limit``/``--seeds`` take one number for
every benchmark or ``bench=N,...``.

The estimate is samples x seconds per sample (:data:`SECONDS_PER_SAMPLE`, per benchmark, measured
with the embedded model; retune them there when generation gets faster) plus :data:`SETUP_SECONDS`.
Other models and endpoints take their own time: the progress lines measure the real rate as the run
goes (:mod:`reflrl.progress`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reflrl.progress import clock_text

BENCHMARKS = ("rotbench", "taskbench", "bfcl", "sealtools")

#: samples per subset of the default run (a subset: ``--full`` runs all)
DEFAULT_LIMIT = {"rotbench": 5, "taskbench": 3, "bfcl": 4, "sealtools": 12}
#: seeds of the default run
DEFAULT_SEEDS = {"rotbench": 2, "taskbench": 2, "bfcl": 2, "sealtools": 2}
#: seeds of ``--full`` (the reproducibility protocol's three)
FULL_SEEDS = 3

#: seconds per sample (one model answer at the default max_new_tokens 256) of the embedded model on
#: 2 idle CPU cores of an AVX512-BF16 Xeon without AMX in bfloat16, per benchmark (prompt lengths differ:
#: TaskBench lists a whole domain's tools), as measured there (docs/results.md). A CPU with AMX runs
#: faster; the progress lines measure the real rate
SECONDS_PER_SAMPLE = {"rotbench": 4.7, "taskbench": 9.0, "bfcl": 3.9, "sealtools": 4.0}
#: loading the model, bfcl-eval and the data, writing the outputs
SETUP_SECONDS = 45.0
#: what the rates above were measured with
RATE_BASIS = "smollm2-135m-instruct in bfloat16 on 2 idle AVX512-BF16 cores without AMX"


def parse_per_benchmark(spec: str | None, option: str) -> tuple[int | None, dict[str, int]]:
    """``"10"`` -> (10, {}); ``"rotbench=10,bfcl=4"`` -> (None, {...}); None -> (None, {}).
    ValueError names the option and the bad part."""
    if spec is None:
        return None, {}
    spec = str(spec).strip()
    if "=" not in spec:
        try:
            n = int(spec)
        except ValueError:
            raise ValueError(f"{option} {spec!r}: expected a whole number or bench=N,... "
                             f"(benchmarks {', '.join(BENCHMARKS)})") from None
        if n < 1:
            raise ValueError(f"{option} must be at least 1 (got {n})")
        return n, {}
    per: dict[str, int] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in BENCHMARKS:
            raise ValueError(f"{option}: unknown benchmark {name!r} in {spec!r}; expected {', '.join(BENCHMARKS)}")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{option}: {part!r} is not bench=N with a whole number N") from None
        if n < 1:
            raise ValueError(f"{option}: {name} must be at least 1 (got {n})")
        per[name] = n
    return None, per


def sizes(benchmarks: list[str], *, limit: str | int | None = None, seeds: str | int | None = None,
          full: bool = False) -> tuple[dict[str, int | None], dict[str, int], str]:
    """Per-benchmark limits (None = every sample) and seed counts of a run, and its mode: ``subset``
    (the defaults), ``full`` or ``custom`` (a ``--limit`` given)."""
    lim_all, lim_per = parse_per_benchmark(None if limit is None else str(limit), "--limit")
    seed_all, seed_per = parse_per_benchmark(None if seeds is None else str(seeds), "--seeds")
    if full and (lim_all is not None or lim_per):
        raise ValueError("--full runs every sample: give --full or --limit, not both")
    limits: dict[str, int | None] = {}
    nseeds: dict[str, int] = {}
    for b in benchmarks:
        if full:
            limits[b] = None
        else:
            limits[b] = lim_per.get(b, lim_all if lim_all is not None else DEFAULT_LIMIT[b])
        nseeds[b] = seed_per.get(b, seed_all if seed_all is not None else (FULL_SEEDS if full else DEFAULT_SEEDS[b]))
    custom = lim_all is not None or any(b in lim_per for b in benchmarks)
    return limits, nseeds, "full" if full else ("custom" if custom else "subset")


@dataclass
class UnitSize:
    key: str  # "rotbench/clean"
    samples: int
    available: int | None  # samples in the data (None: unknown)


@dataclass
class RunPlan:
    """Samples x seeds per benchmark and the time estimate (printed before a run; in the manifest)."""

    mode: str  # subset | full | custom
    units: dict[str, list[UnitSize]] = field(default_factory=dict)  # benchmark -> its units
    seeds: dict[str, int] = field(default_factory=dict)

    def samples(self, benchmark: str) -> int:
        return sum(u.samples for u in self.units.get(benchmark, []))

    def available(self, benchmark: str) -> int | None:
        vals = [u.available for u in self.units.get(benchmark, [])]
        return None if any(v is None for v in vals) else sum(vals)  # type: ignore[arg-type]

    def generations(self, benchmark: str) -> int:
        return self.samples(benchmark) * self.seeds.get(benchmark, 1)

    def estimate_s(self, benchmark: str | None = None) -> float:
        """Estimated seconds of one benchmark's generations, or of the whole run (setup included)."""
        if benchmark is not None:
            return self.generations(benchmark) * SECONDS_PER_SAMPLE.get(benchmark, 4.0)
        return SETUP_SECONDS + sum(self.estimate_s(b) for b in self.units)

    @property
    def is_subset(self) -> bool:
        return any(u.available is None or u.samples < u.available for us in self.units.values() for u in us)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "subset": self.is_subset,
                "benchmarks": {b: {"samples": self.samples(b), "available": self.available(b),
                                   "seeds": self.seeds.get(b), "generations": self.generations(b),
                                   "estimate_s": round(self.estimate_s(b), 1),
                                   "units": {u.key: {"samples": u.samples, "available": u.available}
                                             for u in us}}
                               for b, us in self.units.items()},
                "estimate_s": round(self.estimate_s(), 1),
                "rate_basis": RATE_BASIS, "seconds_per_sample": dict(SECONDS_PER_SAMPLE),
                "setup_s": SETUP_SECONDS}

    def text(self) -> str:
        """The lines printed before the run starts."""
        lines = []
        if self.mode == "subset":
            lines.append("reflrl eval: a SUBSET of each benchmark (the first samples of every subset, "
                         "sized to finish in about 20 minutes on 2 cores); --full runs everything")
        elif self.mode == "full":
            lines.append("reflrl eval: every sample of each benchmark (--full)")
        else:
            lines.append("reflrl eval: " + ("a subset (--limit)" if self.is_subset else "every sample"))
        for b, us in self.units.items():
            avail = self.available(b)
            of = f" of {avail}" if avail is not None else ""
            parts = ", ".join(f"{u.key.split('/', 1)[1]} {u.samples}" + (f"/{u.available}" if u.available else "")
                              for u in us)
            if avail is None:
                parts += "; from the first records, shipped"
            k = self.seeds.get(b)
            lines.append(f"  {b:<9} {self.samples(b)}{of} samples x {k} seed{'s' if k != 1 else ''} = "
                         f"{self.generations(b)} generations, ~{clock_text(self.estimate_s(b))}  ({parts})")
        total = sum(self.generations(b) for b in self.units)
        lines.append(f"  total     {total} generations, estimated {clock_text(self.estimate_s())} "
                     f"(rates of {RATE_BASIS}; other models differ, the progress lines measure it)")
        return "\n".join(lines)
