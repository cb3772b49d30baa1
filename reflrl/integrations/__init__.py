"""Integrations of reflrl's fault-injecting tools with trainers people already use.

- ``reflrl.integrations.trl``: an ``environment_factory`` for TRL's ``GRPOTrainer`` (optional extra
  ``trl``: ``pip install 'reflrl[trl]'``).

Each integration imports its framework only when it is imported itself.
"""
