"""Recipes -> verl config, validated by verl's own checks; the launcher's dry run writes data that
verl's own RLHFDataset reads back."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("verl")

from reflrl.config import ConfigError  # noqa: E402
from reflrl.verl_backend.config import build_verl_config, load_recipe  # noqa: E402
from reflrl.verl_backend.episode import task_from_dict  # noqa: E402
from reflrl.verl_backend.launch import launch as launch_main  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]
RECIPES = [str(_ROOT / "configs/verl/tool_rerl_qwen2.5-7b.yaml"), str(_ROOT / "configs/verl/grpo_efficient_qwen3-4b.yaml")]


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """verl's validation builds HFModelConfig (critic) from the model path: a local tiny model keeps
    the test offline; everything else is the recipe as shipped."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from reflrl.models import load_model, save_checkpoint

    m, t = load_model("tiny-random", dtype="float32", trainable="none")
    return str(save_checkpoint(m, t, tmp_path_factory.mktemp("tiny") / "model"))


def test_tool_rerl_recipe_passes_verls_validation(local_model):
    conf = build_verl_config(load_recipe(RECIPES[0], [f"model.name={local_model}"]))
    a = conf.actor_rollout_ref
    assert a.actor.policy_loss.loss_mode == "reflrl_tool_rerl"
    assert (a.actor.clip_ratio_low, a.actor.clip_ratio_high) == (0.2, 0.2)  # eq. 2: symmetric eps
    assert conf.algorithm.adv_estimator == "gae" and conf.critic.enable  # PPO
    assert conf.data.train_batch_size == 1024 and a.actor.ppo_mini_batch_size == 256  # sec. 4.1
    assert conf.data.max_response_length == 512 and a.rollout.n == 1
    rc = conf.algorithm.rollout_correction
    assert rc.rollout_is == "token" and rc.rollout_is_threshold >= 4.9e8 and not rc.bypass_mode
    assert a.rollout.calculate_log_probs and a.rollout.agent.default_agent_loop == "reflrl_tool_agent"
    assert conf.reward.custom_reward_function.path.endswith("reflrl/verl_backend/reward.py")
    assert conf.reflrl.max_attempts == 2 and "rate_limit" in conf.reflrl.faults
    assert conf.trainer.n_gpus_per_node == 8


def test_reflection_level_and_log_cap_reach_verls_loss(local_model):
    """The CPU trainer's eq. 2 settings (reflection.level, reflection.log_cap) pick the verl loss; a
    cap the registered verl losses do not use is refused rather than silently ignored."""
    conf = build_verl_config(load_recipe(RECIPES[0], [f"model.name={local_model}", "reflection.level=token"]))
    assert conf.actor_rollout_ref.actor.policy_loss.loss_mode == "reflrl_tool_rerl_token"
    with pytest.raises(ConfigError, match="log_cap"):
        build_verl_config(load_recipe(RECIPES[0], [f"model.name={local_model}", "reflection.log_cap=3"]))
    for bad, name in (("train.log_rollouts=true", "rollout_data_dir"), ("algo.downsample_m=2", "downsample_m")):
        with pytest.raises(ConfigError, match=name):
            build_verl_config(load_recipe(RECIPES[0], [f"model.name={local_model}", bad]))


def test_grpo_efficient_recipe_passes_verls_validation(local_model):
    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "verl.n_gpus_per_node=4",
                                                      "verl.reflection.mark_unrepaired=false"]))
    assert conf.reflrl.mark_unrepaired is False and conf.reflrl.max_attempts == 0
    a = conf.actor_rollout_ref
    assert a.actor.policy_loss.loss_mode == "vanilla" and conf.algorithm.rollout_correction.rollout_is is None
    assert (a.actor.clip_ratio_low, a.actor.clip_ratio_high) == (0.2, 0.28)  # appendix F clip-higher
    assert a.actor.optim.lr == 1e-6 and not a.actor.use_kl_loss and a.actor.entropy_coeff == 0
    assert a.rollout.n == 16 and conf.data.train_batch_size == 256 and conf.data.max_prompt_length == 4096
    assert conf.algorithm.adv_estimator == "reflrl_grpo" and conf.trainer.n_gpus_per_node == 4


def test_verls_validation_rejects_a_batch_the_gpus_cannot_split(local_model):
    with pytest.raises(AssertionError, match="divisible"):
        build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "verl.n_gpus_per_node=3"]))


def test_bad_keys_and_incompatible_settings_are_named(local_model):
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.no_such_key"):
        build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}",
                                                   "actor_rollout_ref.actor.no_such_key=1"]), validate_it=False)
    with pytest.raises(ConfigError, match="rollout_is=token"):
        build_verl_config(load_recipe(RECIPES[0], [f"model.name={local_model}",
                                                   "algorithm.rollout_correction.rollout_is=sequence"]))
    with pytest.raises(ConfigError, match="unknown settings"):
        load_recipe(RECIPES[0], ["verl.n_gpu=4"])
    with pytest.raises(ConfigError, match="fault kind|bogus"):
        build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "env.faults=bogus=1"]))


def test_launch_dry_run_writes_data_verl_reads(local_model, tmp_path):
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from reflrl.models import load_tokenizer

    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    conf = launch_main(RECIPES[1], [f"model.name={local_model}", "data.n_train=6", "data.n_val=2", "data.n_test=0",
                                    f"verl.train_files={train}", f"verl.val_files={val}"], dry_run=True)
    assert conf.data.train_files == str(train) and train.exists() and val.exists()
    ds = RLHFDataset(data_files=[str(train)], tokenizer=load_tokenizer("tiny-random"), config=conf.data)
    assert len(ds) == 6
    item = ds[0]
    assert item["agent_name"] == "reflrl_tool_agent"
    task = task_from_dict(item["extra_info"]["task"])
    assert task.gold and task.query == item["raw_prompt"][-1]["content"]


def test_reward_function_loads_through_verls_loader(local_model):
    """verl loads reward.custom_reward_function by file path: our reward scores like the CPU env."""
    import json

    from verl.trainer.ppo.reward import get_custom_reward_fn

    from reflrl.envs.datasets import generate_synthetic, task_to_dict
    from reflrl.envs.parsing import format_calls

    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}"]), validate_it=False)
    fn = get_custom_reward_fn(conf)
    task = generate_synthetic(1, 3, kinds=("single",))[0]
    gt = json.dumps(task_to_dict(task)["gold"])
    right = format_calls(task.gold[0], "hermes")
    good = fn("reflrl", right, gt, {"reward": "binary", "parser": "hermes"})
    bad = fn("reflrl", "no call at all", gt, {"reward": "binary", "parser": "hermes"})
    assert good["score"] == 1.0 and good["correct"] and bad["score"] == 0.0 and not bad["correct"]
    with pytest.raises(ValueError, match="ground_truth"):
        fn("reflrl", right, json.dumps({"not": "a list"}), {})


def test_reflrl_train_backend_verl_dry_run_builds_a_validated_config(capsys):
    """`reflrl train --backend verl --config configs/verl/X.yaml --dry-run` builds verl's config
    through verl's own validation and prints it; a missing recipe is a clear exit 2."""
    from reflrl.cli import main

    rc = main(["train", "--backend", "verl", "--config", str(Path(__file__).resolve().parents[1] / "configs/verl/grpo_efficient_qwen3-4b.yaml"),
               "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "actor_rollout_ref" in out and "algorithm" in out
    rc = main(["train", "--backend", "verl", "--config", "configs/verl/nope.yaml", "--dry-run"])
    assert rc == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["train", "--backend", "verl"]) == 2


# ---------------------------------------------------------------------------- every key decided
from reflrl.verl_backend.config import KEYS, config_keys, verl_keys  # noqa: E402


def test_every_config_field_is_mapped_refused_or_not_needed():
    """Walks every field of the Config dataclasses: each has a decision (a new field without one fails
    here, and the launcher refuses every config until it has one)."""
    keys = config_keys()
    assert len(keys) > 100
    assert [k for k in keys if k not in KEYS] == []
    assert [k for k in KEYS if k not in keys] == []  # no decision for a key that is gone
    for k in keys:
        d = KEYS[k]
        assert d.kind in ("mapped", "refused", "not_needed") and d.note, k
        if d.kind == "refused":
            assert d.accept is not None and d.bad is not None, k


def _set_key(cfg, key, value):
    import dataclasses

    *path, leaf = key.split(".")
    def rebuild(node, parts):
        if not parts:
            return dataclasses.replace(node, **{leaf: value})
        child = getattr(node, parts[0])
        return dataclasses.replace(node, **{parts[0]: rebuild(child, parts[1:])})
    return rebuild(cfg, path)


@pytest.mark.parametrize("key", sorted(k for k, d in KEYS.items() if d.accept is not None and d.bad is not None))
def test_each_refused_value_is_refused_naming_the_key(key, local_model):
    recipe = load_recipe(RECIPES[1], [f"model.name={local_model}"])
    cfg = _set_key(recipe.cfg, key, KEYS[key].bad)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        verl_keys(cfg, recipe.verl)


@pytest.mark.parametrize("key", sorted(k for k, d in KEYS.items() if d.kind == "mapped" and d.probe))
def test_each_mapped_key_reaches_verls_config(key, local_model):
    """Setting the key to its example value changes the verl key it maps to (in one of the recipes: the
    tool_rerl variant fixes the loss, the grpo one does not reflect)."""
    from omegaconf import OmegaConf

    probe, changed = KEYS[key].probe, []
    for path in RECIPES:
        recipe = load_recipe(path, [f"model.name={local_model}"])
        before = build_verl_config(recipe, validate_it=False)
        try:
            recipe.cfg = _set_key(recipe.cfg, key, KEYS[key].example)
            after = build_verl_config(recipe, validate_it=False)
        except ConfigError:  # e.g. critic=llm while this recipe reflects without a critic URL
            continue
        changed.append(OmegaConf.select(before, probe) != OmegaConf.select(after, probe))
    assert any(changed), (key, probe)


def test_lora_and_dtypes_reach_verl(local_model):
    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "model.trainable=lora",
                                                      "model.lora_r=8"]), validate_it=False)
    m = conf.actor_rollout_ref.model
    assert m.lora_rank == 8 and m.lora_alpha == 16 and "q_proj" in list(m.target_modules)
    assert conf.actor_rollout_ref.rollout.dtype == "bfloat16"
    assert conf.actor_rollout_ref.actor.fsdp_config.model_dtype == "fp32"  # float32 master weights
    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "verl.model_dtype=float16"]),
                             validate_it=False)
    assert conf.actor_rollout_ref.rollout.dtype == "float16" and conf.actor_rollout_ref.actor.fsdp_config.dtype == "float16"
    with pytest.raises(ConfigError, match="micro_batch_size"):
        build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "verl.micro_batch_size_per_gpu=2"]),
                          validate_it=False)
    with pytest.raises(ConfigError, match="reflection.max_attempts|reflrl section"):
        load_recipe(RECIPES[1], ["verl.reflection.max_attempts=3"])


def test_cli_dry_run_refuses_a_frozen_bottom(capsys):
    """`reflrl train --backend verl --config ... --dry-run --set model.trainable=top_layers:6`: exit 2 with
    the key and the reason; without it the resolved verl config is printed."""
    from reflrl.cli import main

    recipe = str(Path(__file__).resolve().parents[1] / "configs/verl/tool_rerl_qwen2.5-7b.yaml")
    rc = main(["train", "--backend", "verl", "--config", recipe, "--dry-run", "--set", "model.trainable=top_layers:6"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.trainable='top_layers:6'" in err and "cannot freeze layers" in err


def test_paths_a_ray_actor_uses_are_absolute(local_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "verl.train_files=d/t.parquet",
                                                      "train.out_dir=out"]), validate_it=False)
    assert conf.data.train_files == str(tmp_path / "d" / "t.parquet")
    assert Path(conf.data.val_files).is_absolute()
    assert conf.trainer.default_local_dir == str(tmp_path / "out" / "grpo_efficient_qwen3-4b")


def test_a_rollout_field_verls_yaml_lacks_is_named_with_the_plus_prefix(local_model):
    """enable_sleep_mode is a field of verl's RolloutConfig but not in its YAML: the error says to write '+'."""
    with pytest.raises(ConfigError, match=r"\+actor_rollout_ref\.rollout\.enable_sleep_mode=VALUE"):
        build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}",
                                                   "actor_rollout_ref.rollout.enable_sleep_mode=false"]),
                          validate_it=False)
    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}",
                                                      "+actor_rollout_ref.rollout.enable_sleep_mode=false"]),
                             validate_it=False)
    assert conf.actor_rollout_ref.rollout.enable_sleep_mode is False


def test_preflight_names_a_missing_package_before_any_file_is_written(local_model, tmp_path, monkeypatch):
    """The v1 trainer's transfer_queue made to fail to import: the launcher stops before Ray and before
    writing the data, naming the package and the extra that brings it."""
    import sys

    from reflrl.verl_backend.launch import MissingPackages, preflight

    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # import transfer_queue -> ImportError
    train = tmp_path / "train.parquet"
    with pytest.raises(MissingPackages, match=r"transfer_queue .*'verl' extra \(TransferQueue\)"):
        launch_main(RECIPES[1], [f"model.name={local_model}", f"verl.train_files={train}",
                                 f"verl.val_files={tmp_path / 'val.parquet'}"])
    assert not train.exists()
    conf = build_verl_config(load_recipe(RECIPES[1], [f"model.name={local_model}", "trainer.use_v1=false"]),
                             validate_it=False)
    with pytest.raises(MissingPackages) as e:  # the v0 trainer does not need it; the rollout engine is missing here
        preflight(conf)
    assert "transfer_queue" not in str(e.value) and "vllm" in str(e.value)
