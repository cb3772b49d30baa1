"""Evaluation on the benchmarks the Tool-ReRL paper reports (Tool-ReRL Table 1, appendix B) with
their official metrics, under the reproducibility protocol of the efficiency paper (arXiv:2606.00135) sec. 3.

Modules: ``bfcl`` (bfcl-eval's data, prompt, decoder, checkers), ``bfcl_decode`` (bfcl's decoder
without running model output), ``rotbench``, ``taskbench``,
``sealtools`` (upstream metric rules), ``backends`` (local model, OpenAI-compatible endpoint, run
checkpoint), ``sources`` (the shipped data, pinned downloads, each file's origin), ``plan`` (run size and
time estimate), ``run`` (seeds x benchmarks driver), ``manifest``, ``tables`` (report.md) and ``paper``
(the Tool-ReRL paper's numbers beside the model's), ``compare``; the command line is
:mod:`reflrl.cli.eval` (``reflrl eval`` / ``reflrl data download|list``).
"""
