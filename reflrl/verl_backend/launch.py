"""``reflrl train --backend verl --config configs/verl/X.yaml [overrides]``: launch verl's PPO trainer.

Steps (:func:`launch`):

1. read the recipe and overrides (:func:`reflrl.verl_backend.config.load_recipe`): ``algo.lr=1e-6`` /
   ``reflrl.algo.lr=1e-6`` change our Config, ``verl.n_gpus_per_node=4`` the scale-out settings, any
   other ``key=value`` (``actor_rollout_ref.rollout.gpu_memory_utilization=0.7``, ``+new.key=1``) goes to
   verl's config as it is;
2. write the train/val splits as verl parquet rows (:mod:`reflrl.verl_backend.data`) to
   ``verl.train_files`` / ``verl.val_files`` (our data section: synthetic generator or a loader);
3. build the verl config and validate it with verl's own checks;
4. check that verl sees our plugin (loss + agent loop) in this process, then call verl's own entry
   (``verl.trainer.main_ppo.run_ppo`` with its ``TaskRunnerV1``, or the legacy ``TaskRunner`` when
   ``trainer.use_v1=false``), exactly what ``python -m verl.trainer.main_ppo`` does after Hydra.

First of all, before the recipe is read or anything optional imported, verl itself must import
(:func:`reflrl.verl_backend.require_verl`: one line naming ``pip install 'reflrl[verl]'`` otherwise). Then,
before Ray starts and before any data file is written, :func:`preflight` imports what verl's trainer
and rollout will import (TransferQueue for the default v1 trainer, the rollout engine, Ray, the agent
loop's cachetools/fastapi) and names every missing package with the extra that brings it.

``dry_run=True`` builds and validates the config (step 3) without writing data or checking packages,
and returns it (tested on the CPU). It needs omegaconf (a dependency of reflrl), not verl: without verl
the config is built on reflrl's copy of verl's defaults and only reflrl's own checks run (it says so). The training itself needs GPUs and vLLM/SGLang
(``pip install 'verl[vllm]==0.9.1'``); it was never run end to end. See docs/scale-out.md.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from reflrl.errors import UserError

from . import VERL_VERSION, require_omegaconf, require_verl, verl_available
from .config import Recipe, build_verl_config, load_recipe

#: module -> (what to install, why): the packages a verl run imports beyond verl's base requirements
NEEDED = {
    "ray": ("the 'verl' extra: pip install -e '.[verl]'", "verl schedules its workers on Ray"),
    "transfer_queue": ("the 'verl' extra (TransferQueue): pip install -e '.[verl]'",
                       "verl's default (v1) trainer imports it (trainer.use_v1=true)"),
    "cachetools": ("the 'verl' extra: pip install -e '.[verl]'", "verl's agent-loop module imports it"),
    "fastapi": ("the 'verl' extra: pip install -e '.[verl]'", "verl's agent-loop module imports it"),
    "vllm": ("verl's vllm extra: pip install 'verl[vllm]==0.9.1'", "verl.rollout_engine=vllm"),
    "sglang": ("verl's sglang extra: pip install 'verl[sglang]==0.9.1'", "verl.rollout_engine=sglang"),
}


class MissingPackages(UserError, ImportError):
    """Packages a verl run needs that are not installed (the message names each and how to install it;
    ``reflrl train`` exits 2 with it)."""


def preflight(conf: Any) -> None:
    """Import every package the run will import (:data:`NEEDED`, as ``conf`` selects them) before Ray
    starts; raise :class:`MissingPackages` naming each missing one and the extra that brings it."""
    import importlib

    wanted = ["ray", "cachetools", "fastapi"]
    if conf.trainer.get("use_v1", True):
        wanted.append("transfer_queue")
    engine = str(conf.actor_rollout_ref.rollout.name)
    if engine in NEEDED:
        wanted.append(engine)
    missing = []
    for mod in wanted:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            how, why = NEEDED[mod]
            missing.append(f"{mod} ({why}): install {how} -- {type(e).__name__}: {e}")
    if missing:
        raise MissingPackages("the verl run cannot start, packages are missing:\n  " + "\n  ".join(missing))


def prepare_data(recipe: Recipe) -> dict[str, Path]:
    """Write the recipe's train/val tasks as verl parquet files; returns {"train": path, "val": path}."""
    from reflrl.train.data import splits_from_config

    from .data import rows_from_tasks, write_parquet

    cfg, s = recipe.cfg, recipe.verl
    splits = splits_from_config(cfg.data)
    common = dict(reward=cfg.env.reward, parser=cfg.env.parser, prompt_style=cfg.data.prompt_style,
                  agent_name=s.agent_loop)
    val = splits["val"] or splits["train"][: max(1, min(8, len(splits["train"])))]
    return {"train": write_parquet(rows_from_tasks(splits["train"], **common), s.train_files),
            "val": write_parquet(rows_from_tasks(val, **common), s.val_files)}


def launch(config_path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, dry_run: bool = False,
           write_data: bool = True) -> Any:
    """Launch verl training for a recipe (module doc). Returns the verl config (``dry_run``) or None
    after training. Raises ConfigError / verl's validation errors naming what is wrong."""
    if not dry_run:
        require_verl()  # first: one line naming the extra, before anything else is read or imported
    require_omegaconf()
    recipe = load_recipe(config_path, list(overrides))
    conf = build_verl_config(recipe)
    if dry_run and not verl_available():
        print(f"[reflrl] verl is not installed: this is verl {VERL_VERSION}'s default config (reflrl's copy) with "
              "the recipe applied; verl's own checks did not run (pip install 'reflrl[verl]' runs them)",
              file=sys.stderr)
    if not dry_run:
        preflight(conf)  # before any file is written and before Ray starts
    if write_data:
        paths = prepare_data(recipe)
        print(f"[reflrl] verl data: train {paths['train']}, val {paths['val']}", file=sys.stderr)
    if dry_run:
        return conf
    from verl.utils.device import auto_set_device

    from .plugin import check_registered

    check_registered()
    auto_set_device(conf)
    from verl.trainer.main_ppo import run_ppo

    if conf.trainer.use_v1:
        from verl.trainer.main_ppo import TaskRunnerV1 as runner
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner as runner
    run_ppo(conf, task_runner_class=runner)
    return None
