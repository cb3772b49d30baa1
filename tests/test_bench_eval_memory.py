"""scripts/bench_eval_memory.py runs one evaluation from a checkpoint with its AdamW state, moved to disk
(the trainer's way) or kept in memory, and prints both the state's size and the evaluation's figures."""
from __future__ import annotations

import re

from reflrl import config as C
from reflrl.train import loop as T
from script_loader import load_script

TINY = ["model.name=tiny-random", "model.dtype=float32", "model.trainable=all", "data.n_train=4", "data.n_val=0",
        "data.n_test=2", "warmup.enabled=false", "train.threads=1", "rollout.max_new_tokens=8"]


def test_evaluation_from_a_checkpoint_with_its_optimizer_state_on_disk_and_kept(tmp_path, capsys):
    cfg = C.load_config(None, TINY + ["env.faults=", f"train.out_dir={tmp_path}", "train.run_name=run"])
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True)
    params = [p for p in tr.model.parameters() if p.requires_grad]
    sum(p.square().sum() for p in params).backward()
    tr.optimizer.step()  # AdamW state to save: two moments per trainable parameter
    state_mb = sum(s[k].numel() * 4 for s in tr.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")) / 1e6
    assert state_mb > 0.1  # large enough for the printed size to tell a missing state apart
    ck = tr.save()
    bem = load_script("bench_eval_memory")
    sets = [a for kv in TINY for a in ("--set", kv)]
    out = {}
    for flag in ([], ["--keep-optimizer-state"]):
        assert bem.main(["--checkpoint", str(ck), "--faults", "", *sets, *flag]) == 0
        out[bool(flag)] = capsys.readouterr().out
    for text, mode in ((out[False], "on disk"), (out[True], "kept in memory")):
        assert f"AdamW state {state_mb:.1f} MB" in text
        m = re.search(rf"optimiser state {mode}: \d+ s, accuracy ([\d.]+), peak resident ([\d.]+) GB", text)
        assert m and float(m.group(2)) > 0
    accs = {re.search(r"accuracy ([\d.]+)", t).group(1) for t in out.values()}
    assert len(accs) == 1  # the same evaluation either way
