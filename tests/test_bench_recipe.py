"""scripts/bench_recipe.py's aggregate: the three accuracies and the paired RL gain over seeds."""
from __future__ import annotations

from script_loader import load_script


def test_aggregate_prints_the_three_accuracies_and_the_paired_rl_gain():
    br = load_script("bench_recipe")
    rows = [{"seed": s, "before": 0.0, "after_warmup": w, "after": a, "rl_gain": a - w, "wall_s": 600.0,
             "recipe_complete": s != 2, "recovery": {"reflected": 10, "recovered_by_reflection": r,
                                                     "recovered_policy_error": r}}
            for s, w, a, r in ((0, 0.40, 0.50, 3), (1, 0.30, 0.45, 4), (2, 0.50, 0.45, 5))]
    lines = br.aggregate_lines(rows)
    text = "\n".join(lines)
    assert "accuracy after warm-up:  0.400 ± 0.100" in text
    assert "accuracy after RL:       0.467 ± 0.029" in text
    # paired: mean of (0.10, 0.15, -0.05), not the difference of the means' stds
    rl = next(l for l in lines if l.startswith("RL gain"))
    assert "0.067 ± 0.104" in rl and "+10.0, +15.0, -5.0 points" in rl and "positive in 2 of 3" in rl
    assert "recovered 12 of 30 reflected failures (40.0%" in text
    assert "CUT BY THE TIME GUARD: seed(s) 2" in lines[-1]


def test_fault_lines_give_paired_gains_and_rl_minus_the_equal_time_control():
    br = load_script("bench_recipe")

    def h(acc, clean, rec):
        return {"accuracy": acc, "clean_accuracy": clean, "recovery_under_faults": rec,
                "reflection_ratio_env_fault": None, "reflection_ratio_policy_error": 0.0}
    rows = [{"heldout": {"after_warmup": h(0.4, 0.5, 0.1), "after": h(0.45, 0.5, 0.4)},
             "control": h(0.5, 0.6, 0.2)},
            {"heldout": {"after_warmup": h(0.3, 0.4, 0.2), "after": h(0.35, 0.38, 0.3)},
             "control": h(0.3, 0.4, 0.35)}]
    lines = br.fault_lines(rows)
    rec = next(x for x in lines if x.startswith("recovery_under_faults"))
    assert "RL gain (paired) 0.200 ± 0.141" in rec and "+30.0, +10.0 points" in rec
    assert "RL - equal-time SFT 0.075 ± 0.177" in rec and "+20.0, -5.0; RL above in 1 of 2" in rec
    assert not any(x.startswith("reflection_ratio_env_fault") for x in lines)  # nothing measured
    # the control's supervised steps: the RL phase's seconds at the warm-up's rate
    assert br.control_steps({"rl_seconds": 424.5, "warmup": {"sft_seconds": 236.0, "sft_steps": 60}}) == 108


def test_main_evaluates_the_base_once_and_resumes_finished_seeds(tmp_path, capsys):
    """The first seed evaluates the base model; the later seeds and every control skip it
    (train.eval_before=false) and take the first seed's numbers; a second run with the same --name reuses
    the finished seeds' rows instead of training again, and refuses other settings under that name."""
    import json

    br = load_script("bench_recipe")
    calls: list[list[str]] = []

    def fake_run_train(cmd, run_dir, cwd=None):
        calls.append(cmd)
        run_dir.mkdir(parents=True, exist_ok=True)
        skip = "train.eval_before=false" in cmd
        h = {"accuracy": 0.5, "clean_accuracy": 0.6, "recovery_under_faults": 0.2, "n_faulted": 5, "n_clean": 20,
             "reflection_ratio_env_fault": 0.5, "reflection_ratio_policy_error": 0.0}
        s = {"accuracy_before": None if skip else 0.0, "accuracy_after": 0.5, "accuracy_after_warmup": 0.45,
             "rl_gain": 0.05, "format_rate_before": None if skip else 0.0, "steps": 8, "masked_trajectories": 0,
             "faults": {"faults_by_kind": {"rate_limit": 3}}, "run_dir": str(run_dir), "rl_seconds": 100.0,
             "warmup": {"ran": True, "sft_seconds": 60.0, "sft_steps": 60}, "eval_after": {"n": 25},
             "heldout": {"after_warmup": h, "after": h}}
        (run_dir / "summary.json").write_text(json.dumps(s))
        return s, 1.0

    br.run_train = fake_run_train
    args = ["--seeds", "0,1", "--out", str(tmp_path), "--name", "b", "--test-size", "25"]
    assert br.main(args) == 0
    main_runs = [c for c in calls if not any(x.startswith("model.init_from=") for x in c)]
    controls = [c for c in calls if c not in main_runs]
    assert len(main_runs) == 2 and len(controls) == 2
    assert "train.eval_before=false" not in main_runs[0]  # the first seed evaluates the base model
    assert "train.eval_before=false" in main_runs[1] and "warmup.enabled=true" in main_runs[1]
    assert all("train.eval_before=false" in c for c in controls)
    row1 = json.loads((tmp_path / "b-s1.json").read_text())
    assert row1["before"] == 0.0 and row1["control_steps"] == 100
    out = capsys.readouterr().out
    assert "2 seeds" in out
    calls.clear()
    assert br.main(args) == 0 and calls == []  # both seeds reused
    assert br.main([*args, "--faults", "timeout=0.1"]) == 2 and calls == []
    # no base evaluation at all (every seed skips it): the printout says n/a instead of failing
    skip = ["--seeds", "0", "--out", str(tmp_path), "--name", "c", "--set", "train.eval_before=false",
            "--set", "warmup.enabled=true"]
    assert br.main(skip) == 0
    assert "seed 0: base n/a -> after warm-up 45.0%" in capsys.readouterr().out


def test_arms_run_from_the_seeds_warmup_checkpoint_and_are_compared_paired(tmp_path, capsys):
    """--arms grpo,cot_is: each arm is a run of the same config from the seed's step-0 checkpoint with only
    reflection.variant changed, and the printout gives the recipe's RL minus the arm per seed; a config's own
    faults are used when --faults is not given."""
    import json

    br = load_script("bench_recipe")
    calls: list[list[str]] = []
    adapt = {"tool_rerl": 0.5, "grpo": 0.3, "cot_is": 0.1}

    def fake_run_train(cmd, run_dir, cwd=None):
        calls.append(cmd)
        run_dir.mkdir(parents=True, exist_ok=True)
        variant = next((c.split("=", 1)[1] for c in cmd if c.startswith("reflection.variant=")), "tool_rerl")
        h = {"accuracy": 0.4, "clean_accuracy": 0.5, "adaptation": adapt[variant], "n_faulted": 10}
        s = {"accuracy_before": None, "accuracy_after": 0.4, "accuracy_after_warmup": 0.3, "rl_gain": 0.1,
             "steps": 8, "masked_trajectories": 0, "faults": {"faults_by_kind": {}}, "run_dir": str(run_dir),
             "rl_seconds": 100.0, "warmup": {"ran": True, "sft_seconds": 60.0, "sft_steps": 60},
             "eval_after": {"n": 48}, "heldout": {"after_warmup": dict(h, adaptation=0.1), "after": h}}
        (run_dir / "summary.json").write_text(json.dumps(s))
        return s, 1.0

    br.run_train = fake_run_train
    assert br.main(["--seeds", "0", "--out", str(tmp_path), "--name", "a", "--config", "configs/api_changes.yaml",
                    "--no-control", "--arms", "grpo,cot_is"]) == 0
    assert not any("--faults" in c for c in calls)  # the config's own faults
    arms = {c[c.index("--name") + 1]: c for c in calls[1:]}
    assert set(arms) == {"a-s0-grpo", "a-s0-cot_is"}
    ck = tmp_path / "a-s0" / "checkpoints" / "step_000000"
    for arm, c in arms.items():
        assert f"model.init_from={ck}" in c and "warmup.enabled=false" in c
        assert f"reflection.variant={arm.rsplit('-', 1)[1]}" in c
    out = capsys.readouterr().out
    assert "grpo adaptation: 0.300" in out and "the recipe's RL - grpo 0.200" in out and "+20.0; above in 1 of 1" in out
    assert "cot_is adaptation: 0.100" in out and "+40.0" in out
