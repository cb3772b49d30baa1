"""Benchmark test data shipped with reflrl, in the ``--data-dir`` layout (gzipped upstream bytes).

RoTBench (Apache-2.0), Seal-Tools (Apache-2.0) and TaskBench (MIT); each folder keeps its upstream
licence, ``ATTRIBUTION.md`` names every file's repository, commit, path and hashes.
:mod:`reflrl.eval.sources` pins them and downloads what is not shipped.
"""
