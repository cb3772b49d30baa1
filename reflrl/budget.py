"""The run's time budget is a guard, not part of the recipe.

A recipe is defined by step counts, so the same seed gives the same result on any machine. The
budget (``train.time_budget_min`` for the whole run, ``warmup.time_budget_min`` for the warm-up) only
stops a run that would take far longer than planned. A phase it cuts is recorded as a *cut*
(:func:`cut_record`) in the run's summary (``budget_cuts``, ``recipe_complete: false``), said in the log
and the report (:func:`budget_cut_text`), and ``reflrl train`` then exits with
:data:`EXIT_BUDGET_CUT`: a cut run is never mistaken for the recipe's result.
"""
from __future__ import annotations

from typing import Any

from reflrl.errors import IncompleteRun

EXIT_BUDGET_CUT = IncompleteRun.exit_code  # `reflrl train` exit status when the time guard cut a phase


def cut_record(phase: str, done: int, planned: int, *, elapsed_s: float, budget_min: float | None,
               warmup_budget_min: float | None = None) -> dict[str, Any]:
    """What a cut records: the phase, steps done of planned, when, and under which budget."""
    return {"phase": phase, "done": int(done), "planned": int(planned), "elapsed_s": round(float(elapsed_s), 1),
            "budget_min": budget_min, "warmup_budget_min": warmup_budget_min}


def budget_cut_text(cut: dict[str, Any]) -> str:
    """One sentence on a cut (log, summary, report)."""
    which = (f"warmup.time_budget_min={cut['warmup_budget_min']:g}"
             if cut.get("phase") == "warm-up" and cut.get("warmup_budget_min") is not None
             else f"train.time_budget_min={cut.get('budget_min')}")
    return (f"the time budget ({which}) cut the {cut['phase']} at step {cut['done']} of {cut['planned']} "
            f"after {float(cut.get('elapsed_s', 0)) / 60:.1f} min: this result is NOT the recipe's (this machine "
            "ran slower than the recipe was sized for; raise the budget, or set it to null, to run the recipe whole)")
