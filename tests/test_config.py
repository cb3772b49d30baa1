"""Config: YAML + dotted overrides -> typed dataclasses; errors name the key; round-trip."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reflrl.config import (
    Config,
    ConfigError,
    config_diff,
    config_help,
    config_to_dict,
    dump_config,
    load_config,
    parse_override,
    save_config,
)

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_default_yaml_load_and_list_every_key():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.algo.clip_low == 0.2 and cfg.algo.clip_high == 0.28
    assert cfg.algo.advantage == "grpo" and cfg.algo.loss_agg == "token-mean"
    # the defaults are the default recipe: default.yaml changes no key, and it runs the embedded model
    assert load_config(ROOT / "configs" / "default.yaml") == cfg
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.reflection.variant == "tool_rerl"
    # the file is a header only; the resolved config with every key's help is printed on demand
    assert yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()) is None
    text = dump_config(cfg)
    for f in dataclasses.fields(Config):
        assert f"\n{f.name}:" in "\n" + text


def test_load_config_none_is_what_reflrl_train_runs_without_arguments(tmp_path, monkeypatch):
    """One source of defaults: `reflrl train` with no arguments resolves exactly load_config(None), key by key
    (the run folder's name aside); so does a user's YAML without `base:` for the keys it does not set."""
    from reflrl.cli import build_parser
    from reflrl.cli.train import resolve_config

    monkeypatch.chdir(tmp_path)
    cfg, run_dir, resume = resolve_config(build_parser().parse_args(["train"]))
    assert not resume and run_dir.parent == Path("runs")
    assert config_diff(cfg, load_config(None)) == {}
    faulty, _, _ = resolve_config(build_parser().parse_args(["train", "--faults", "rate_limit=0.1"]))
    assert config_diff(faulty, load_config(None)) == {"env.faults": ("", "rate_limit=0.1")}
    own = tmp_path / "mine.yaml"
    own.write_text("algo:\n  lr: 1.0e-4\n")
    assert config_diff(load_config(own), load_config(None)) == {"algo.lr": (5e-5, 1e-4)}


def test_validation_is_named_checks_per_section_that_ask_the_registries():
    """Each section has its named checks; a name registered by a plugin is accepted (asked from the registry)."""
    from reflrl.config import checks
    from reflrl.registry import DIRECTORY, names

    found = checks()
    assert {f.name for f in dataclasses.fields(Config)} <= set(found)
    assert any(n.endswith("(trainer)") for n in found["reflection"])
    for kind in DIRECTORY:
        assert names(kind), kind


def test_trainer_checks_are_apart_from_validation():
    """A config the verl backend can run (an entropy bonus) validates; the CPU trainer's own limits refuse it."""
    from reflrl.config import check_trainer

    for sets, needle in ((["reflection.variant=ppo"], "algo.advantage=gae"), (["algo.entropy_coef=0.01"], "entropy"),
                         (["model.trainable=none"], "no trainable parameter"),
                         (["reflection.variant=dpo", "algo.epochs_per_batch=2"], "one DPO step")):
        cfg = load_config(None, sets)  # valid as a config
        with pytest.raises(ConfigError, match=needle):
            check_trainer(cfg)
    assert check_trainer(load_config(None)) == load_config(None)


def test_tiny_yaml_loads():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    assert cfg.model.name == "tiny-random"
    assert cfg.train.steps <= 5 and cfg.rollout.n >= 2


def test_overrides_typed_values_and_first_equals_split():
    cfg = load_config(None, [
        "algo.clip_high=0.3",
        "train.steps=20",
        "env.faults=rate_limit=0.1,timeout=0.05",
        "data.kinds=[single, multiple]",
        "env.retry.max_attempts=2",
        "sampling.refill=true",
        "algo.dual_clip_c=3",
        "algo.lr=1e-5",
        "train.run_name=null",
        "model.name=1e-5",
        "warmup.enabled=false",
        "train.time_budget_min=null",
    ])
    assert cfg.algo.clip_high == 0.3 and isinstance(cfg.algo.clip_high, float)
    assert cfg.train.steps == 20
    assert cfg.env.faults == "rate_limit=0.1,timeout=0.05"
    assert cfg.data.kinds == ["single", "multiple"]
    assert cfg.env.retry.max_attempts == 2
    assert cfg.sampling.refill is True
    assert cfg.algo.dual_clip_c == 3.0 and isinstance(cfg.algo.dual_clip_c, float)
    assert cfg.algo.lr == 1e-5
    assert cfg.train.run_name is None
    assert cfg.model.name == "1e-5"  # string fields keep the text
    assert cfg.warmup.enabled is False
    assert cfg.train.time_budget_min is None
    assert load_config(None, ["data.kinds=single,parallel"]).data.kinds == ["single", "parallel"]


def test_overrides_apply_on_top_of_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  clip_high: 0.25\n  lr: 1e-5\ntrain:\n  steps: 7\n")
    cfg = load_config(p, ["train.steps=9"])
    assert cfg.algo.clip_high == 0.25 and cfg.algo.lr == 1e-5 and cfg.train.steps == 9
    assert cfg.algo.clip_low == 0.2  # untouched keys keep defaults
    assert parse_override("env.faults=a=1=2") == (["env", "faults"], "a=1=2")


@pytest.mark.parametrize("override, needles", [
    ("algo.clip_hihg=0.3", ["algo.clip_hihg", "did you mean 'clip_high'", "clip_low"]),
    ("algx.lr=1", ["'algx'", "did you mean 'algo'", "rollout"]),
    ("env.retry.attempts=1", ["env.retry.attempts", "max_attempts"]),
    ("algo.clip_high=abc", ["algo.clip_high", "expected float", "'abc'"]),
    ("train.steps=1.5", ["train.steps", "expected int", "1.5"]),
    ("train.steps=true", ["train.steps", "expected int", "True"]),
    ("sampling.refill=1", ["sampling.refill", "expected bool"]),
    ("algo.dynamic_sampling=true", ["algo.dynamic_sampling", "allowed keys"]),
    ("data.kinds=3", ["data.kinds", "list of str"]),
    ("algo.lr", ["key=value"]),
    ("algo.lr.x=1", ["algo.lr", "not a section"]),
    ("algo=3", ["algo", "mapping"]),
    ("algo.advantage=grp", ["algo.advantage", "did you mean 'grpo'"]),
    ("algo.loss_agg=token_mean", ["algo.loss_agg", "token-mean"]),
    ("model.trainable=top_layers:0", ["model.trainable"]),
    ("algo.downsample_m=8", ["algo.downsample_m", "rollout.n"]),
    ("rollout.n=0", ["rollout.n", ">= 1"]),
    ("warmup.enabled=maybe", ["warmup.enabled", "'maybe'"]),
    ("train.run_name=../x", ["train.run_name"]),
    ("reflection.reveal=vaule", ["reflection.reveal", "did you mean 'value'", "call"]),
])
def test_bad_overrides_name_the_key(override, needles):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    for needle in needles:
        assert needle in str(exc.value), (needle, str(exc.value))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)
    p.write_text("model:\n  nmae: x\n")
    with pytest.raises(ConfigError, match=r"model\.nmae.*did you mean 'name'"):
        load_config(p)
    p.write_text("rollout:\n  temperature: hot\n")
    with pytest.raises(ConfigError, match=r"rollout\.temperature: expected float, got str 'hot'"):
        load_config(p)
    p.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_base_key_layers_a_partial_recipe_on_another_file(tmp_path):
    (tmp_path / "base.yaml").write_text("rollout:\n  n: 3\n  batch_prompts: 5\nalgo:\n  lr: 0.5\n")
    (tmp_path / "mid.yaml").write_text("base: base.yaml\nrollout:\n  n: 7\n")
    (tmp_path / "top.yaml").write_text("base: mid.yaml\nalgo:\n  lr: 0.25\n")
    cfg = load_config(tmp_path / "top.yaml", ["rollout.batch_prompts=9"])
    assert (cfg.rollout.n, cfg.rollout.batch_prompts, cfg.algo.lr) == (7, 9, 0.25)
    assert load_config(tmp_path / "mid.yaml").rollout.batch_prompts == 5  # the base's key is kept
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "gone.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "gone.yaml")


def test_several_value_errors_reported_together():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["rollout.n=0", "algo.clip_low=1.5"])
    assert "rollout.n" in str(exc.value) and "algo.clip_low" in str(exc.value)


def test_round_trip_through_run_folder(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        "env.faults=rate_limit=0.1", "algo.lr=3e-6", "train.run_name=x1", "data.path=/tmp/a b.jsonl",
        "model.name=true", "env.fault_seed=7", "algo.value_clip=null", "data.kinds=[multi_turn]",
    ])
    path = save_config(cfg, tmp_path / "run" / "config.yaml", header="run x1")
    again = load_config(path)
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert dump_config(again) == dump_config(cfg)


def test_config_diff_and_help():
    cfg = load_config(None, ["algo.clip_high=0.3", "env.retry.budget_s=5"])
    assert config_diff(cfg) == {"algo.clip_high": (0.28, 0.3), "env.retry.budget_s": (30.0, 5.0)}
    text = config_help()
    for f in dataclasses.fields(Config):
        assert f"\n{f.name}." in "\n" + text
    assert "algo.clip_high (float, default 0.28)" in text


def test_names_are_validated_by_asking_the_registries_and_import_is_torch_free():
    """Algorithm, sampler, variant, critic and engine names are whatever their registries know: a name
    a plugin registers is accepted at once, a typo is refused with a suggestion. Importing the config
    module loads no torch (validating a config asks the registries, which do)."""
    from reflrl.algos.registry import ADVANTAGES, POLICY_LOSSES, register_advantage

    assert set(ADVANTAGES.names()) >= {"grpo", "dr_grpo", "rloo", "gae"}
    assert set(POLICY_LOSSES.names()) >= {"clip_higher", "ppo_clip", "tool_rerl"}
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        load_config(None, ["algo.advantage=grop"])
    if "test_plugin_adv" not in ADVANTAGES:
        register_advantage("test_plugin_adv")(lambda **kw: None)
    assert load_config(None, ["algo.advantage=test_plugin_adv"]).algo.advantage == "test_plugin_adv"
    for key, bad in (("sampling.sampler", "rdss"), ("reflection.variant", "toolrerl"), ("reflection.critic", "rul"),
                     ("rollout.engine", "vlm")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}={bad}"])
    code = "import sys, reflrl.config as c; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rl_rollouts_meet_the_scaled_faults_and_the_evaluation_the_given_ones():
    from reflrl.config import load_config, train_faults, ConfigError, validate

    cfg = load_config(None, ["env.faults=rate_limit=0.1", "env.train_fault_scale=3"])
    assert train_faults(cfg.env) == "rate_limit=0.3" and cfg.env.faults == "rate_limit=0.1"
    cfg = load_config(None, ["env.faults=rate_limit=0.3,timeout=0.1", "env.train_fault_scale=4"])
    assert train_faults(cfg.env) == "rate_limit=0.375,timeout=0.125"  # total capped at train_fault_cap 0.5
    assert train_faults(load_config(None, ["env.train_fault_scale=3"]).env) == ""
    with pytest.raises(ConfigError, match="env.train_fault_cap"):
        validate(load_config(None, ["env.train_fault_cap=0"]))
