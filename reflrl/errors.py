"""The errors reflrl reports to its user, one tree (as httpx's): the class says what went wrong and how
the ``reflrl`` command exits; the message says what to do.

    ReflrlError                 exit 1   base; never raised itself
    ├── UserError               exit 2   the user's input: config, fault spec, grid, data, unknown name
    │   └── ConfigError                  a bad config file, override or value (names the key path)
    ├── IncompleteRun           exit 3   the run ended, but its result is not the recipe's (time budget cut)
    └── ResourceError           exit 4   the machine lacks something the run needs
        └── DiskSpaceError               not enough free disk space (also an OSError, errno ENOSPC)

Other modules subclass these (``GridError``, ``SweepError``, ``DataError``, ``ReportError``,
``UnknownName`` are UserErrors). The standalone layers ``faults/`` and ``envs/`` import nothing of the
core, so their user errors (``FaultSpecError``, ``ProxyError``) are listed in :data:`FOREIGN_USER_ERRORS`.
Anything else reaching the command line is a bug: it is shown with its traceback (``reflrl.cli``).

This module imports nothing of reflrl, so every layer can raise these without importing the config machinery
(:class:`ConfigError` is re-exported by :mod:`reflrl.config`).
"""
from __future__ import annotations

import sys


class ReflrlError(Exception):
    """Base of the errors reflrl reports to its user without a traceback; ``exit_code``: the command's
    exit status for it."""

    exit_code = 1


class UserError(ReflrlError):
    """Something the user gave is wrong or missing (a config key, a fault spec, a grid, a data file, an
    unknown name); the message names it. Exit status 2."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A bad config file, override or value; the message names the key path."""


class IncompleteRun(ReflrlError):
    """The run ended and wrote its summary, but a phase was cut (``train.time_budget_min``), so its result
    is not the recipe's. Exit status 3."""

    exit_code = 3


class ResourceError(ReflrlError):
    """The machine lacks a resource the command needs (disk space). Exit status 4."""

    exit_code = 4


class DiskSpaceError(ResourceError, OSError):
    """Not enough free disk space for what must be written (a run's checkpoints, the embedded model's
    conversion); the message names the folder, the bytes free and needed, and what to do. ``errno``
    is ``ENOSPC``."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror) if self.strerror else super().__str__()


# User errors of the standalone layers, which import nothing of the core: (module, class name).
FOREIGN_USER_ERRORS = (("reflrl.faults.spec", "FaultSpecError"), ("reflrl.envs.proxy", "ProxyError"),
                       ("reflrl.envs.tools.bfcl_backends", "BfclMissing"))


def exit_code(exc: BaseException) -> int | None:
    """The exit status for ``exc`` if it is an error the user can act on (the tree above, or a user error
    of the standalone ``faults``/``envs`` layers); None for anything else (a bug: show the traceback)."""
    if isinstance(exc, ReflrlError):
        return exc.exit_code
    for module, name in FOREIGN_USER_ERRORS:  # an instance's class is loaded, so its module is too
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return UserError.exit_code
    return None


def message(exc: BaseException) -> str:
    """The one line (or few) shown for a user-facing error."""
    return str(exc) or type(exc).__name__
