"""Experiments over many training runs: ``reflrl experiment faults`` (a fault-injection sweep).

- :mod:`reflrl.experiment.grid`: the ``--faults`` grid grammar and how it expands into settings;
- :mod:`reflrl.experiment.sweep`: cells (method x fault setting x seed), the sweep manifest, the
  resumable runner (each cell a ``reflrl train`` subprocess) and the ETA;
- the argparse wiring is :mod:`reflrl.cli.experiment`.
"""
