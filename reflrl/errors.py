"""Errors a user sees, in a module of their own so that any layer can raise them without importing
the config machinery (:class:`ConfigError` is re-exported by :mod:`reflrl.config`)."""


class ConfigError(ValueError):
    """A bad config file, override or value; the message names the key path."""


class DiskSpaceError(OSError):
    """Not enough free disk space for what must be written (a run's checkpoints, the embedded model's
    conversion); the message names the folder, the bytes free and needed, and what to do. ``errno``
    is ``ENOSPC``."""
