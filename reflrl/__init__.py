"""reflrl: reinforcement learning for LLM tool calling, through misbehaving tools.

    import reflrl
    cfg = reflrl.load_config("configs/tiny.yaml")
    summary = reflrl.Trainer(cfg, "runs/first").run()

``Trainer``, ``train``, ``Callback``, ``load_config`` and ``ConfigError`` are imported on first use (a bare
``import reflrl`` does not import torch)."""

__version__ = "0.1.0"

_LAZY = {"Trainer": "reflrl.train", "train": "reflrl.train", "Callback": "reflrl.train",
         "load_config": "reflrl.config", "Config": "reflrl.config", "ConfigError": "reflrl.errors"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'reflrl' has no attribute {name!r}")


__all__ = ["Callback", "Config", "ConfigError", "Trainer", "load_config", "train", "__version__"]
