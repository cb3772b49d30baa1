"""Shared test settings.

Torch runs on one thread in tests: the suite's tiny models gain nothing from a second thread,
and tests that run a tool server or a subprocess beside torch would otherwise oversubscribe a
2-core machine (measured: tiny-model generation 1.5 s with 1 thread vs 14 s with 2 under load).
Hub access is off: every model a test loads ships in a package or is built locally.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return
    torch.set_num_threads(1)
