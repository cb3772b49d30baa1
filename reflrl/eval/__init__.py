"""Evaluation on the benchmarks the Tool-ReRL paper reports (Tool-ReRL Table 1, appendix B) with
their official metrics, under the reproducibility protocol of the efficiency paper (arXiv:2606.00135) sec. 3.

Modules: ``bfcl`` (bfcl-eval's data, prompt, decoder, checkers), ``bfcl_decode`` (bfcl's decoder
without running model output), ``rotbench``, ``taskbench``,
``sealtools`` (upstream metric rules), ``backends`` (local model, OpenAI-compatible endpoint, run
checkpoint), ``run`` (seeds x benchmarks driver), ``manifest``, ``report``, ``compare``, ``download``,
``cli`` (``reflrl eval`` / ``reflrl data download``).
"""
