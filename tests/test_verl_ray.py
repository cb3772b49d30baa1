"""verl's own plugin loader finds reflrl inside a Ray worker: the worker only runs ``import verl``
(as verl's workers do) and our loss and agent loop are registered there."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")


def _registries_after_import_verl() -> dict:
    import sys

    import verl  # noqa: F401  (runs verl's entry-point loader)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    reg = {}
    try:
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

        reg = dict(_agent_loop_registry)
    except ImportError:
        pass
    return {"pid": os.getpid(), "losses": sorted(k for k in POLICY_LOSS_REGISTRY if k.startswith("reflrl")),
            "agent_loops": sorted(k for k in reg if k.startswith("reflrl")),
            "advantages": sorted(k for k in ADV_ESTIMATOR_REGISTRY if k.startswith("reflrl")),
            "plugin_loaded": "reflrl.verl_backend.plugin" in sys.modules}


def test_plugin_is_loaded_by_verl_in_a_ray_worker(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # a short private folder: Ray's unix socket paths must stay under 107 bytes (pytest's tmp_path is too deep)
    temp = tempfile.mkdtemp(prefix="rr-", dir="/tmp")
    try:
        import sys

        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test file
        ctx = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
        try:
            out = ray.get(ray.remote(_registries_after_import_verl).remote(), timeout=240)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert ctx is not None and out["pid"] != os.getpid()  # really another process
    assert out["plugin_loaded"]
    assert out["losses"] == ["reflrl_tool_rerl", "reflrl_tool_rerl_seqmean", "reflrl_tool_rerl_token"]
    assert out["agent_loops"] == ["reflrl_tool_agent"]
    assert out["advantages"] == ["reflrl_dr_grpo", "reflrl_grpo"]
