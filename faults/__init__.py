"""reflrl.faults: reproducible fault injection for tool environments.

- ``FaultPlan`` / ``FaultSpecError``: the ``kind=prob[:param],...`` grammar (spec.py).
- ``decide``: the pure per-attempt decision (decide.py).
- ``KINDS`` / ``format_kinds_table``: the twelve kinds and what a client sees (kinds.py): ten drawn per
  attempt (``ATTEMPT_KINDS``) and two API changes, sticky per episode and tool (``CHANGE_KINDS``).
- ``ApiChange`` / ``ChangeBook`` / ``api_change``: the API changes' pure decision (evolve.py).
- ``Ledger``: injected vs observed, ``reconcile()`` and totals (ledger.py).
- ``FaultInjector``: the ASGI middleware the tool server puts in front of its routes (inject.py).
- ``parse_coords`` / ``episode_id_problem``: the attempt coordinates every call carries and the
  rules they follow (coords.py).

Nothing here imports torch or the trainer.
"""
from .coords import CoordError, Coords, episode_id_problem, parse_coords
from .decide import FaultDecision, decide, draw
from .evolve import ApiChange, ChangeBook, api_change
from .inject import FaultInjector, FaultSite, is_corrupt
from .kinds import ATTEMPT_KINDS, CHANGE_KINDS, KIND_NAMES, KINDS, FaultKind, format_kinds_table, is_file_tool, kinds_rows
from .ledger import (CallRecord, FaultEvent, KindCounts, Ledger, LedgerError, LedgerTotals,
                     Mismatch, ReconcileReport)
from .spec import FaultEntry, FaultPlan, FaultSpecError, format_duration, parse_duration

__all__ = [
    "CoordError", "Coords", "episode_id_problem", "parse_coords",
    "FaultDecision", "decide", "draw",
    "ApiChange", "ChangeBook", "api_change",
    "FaultInjector", "FaultSite", "is_corrupt",
    "ATTEMPT_KINDS", "CHANGE_KINDS", "KIND_NAMES", "KINDS", "FaultKind", "format_kinds_table", "is_file_tool", "kinds_rows",
    "CallRecord", "FaultEvent", "KindCounts", "Ledger", "LedgerError", "LedgerTotals", "Mismatch",
    "ReconcileReport",
    "FaultEntry", "FaultPlan", "FaultSpecError", "format_duration", "parse_duration",
]
