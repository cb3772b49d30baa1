"""reflrl report: every plot present and non-blank, missing files reported, HTML renders in headless
Chromium without console errors, derived numbers (temporal stability, recovery ratio)."""
from __future__ import annotations

import base64
import json
import io
import re
import shutil
import subprocess

import pytest
from PIL import Image, ImageStat

from reflrl.cli import main
from reflrl.report import build_report, load_run
from reflrl.report import derive as D
from reflrl.report.plots import RUN_PLOTS, SWEEP_PLOTS

from report_fixtures import make_run, make_sweep


def assert_real_png(data: bytes, name: str) -> None:
    """Decodes as a PNG of a real figure: non-trivial size and not a blank canvas."""
    assert len(data) > 8000, f"{name}: only {len(data)} bytes"
    img = Image.open(io.BytesIO(data))
    img.load()
    assert img.format == "PNG" and img.width >= 400 and img.height >= 250, name
    stat = ImageStat.Stat(img.convert("L"))
    assert stat.stddev[0] > 15, f"{name}: looks blank (pixel std {stat.stddev[0]:.1f})"
    # not almost entirely one colour
    hist = img.convert("L").histogram()
    assert max(hist) / sum(hist) < 0.97, f"{name}: one colour covers the image"


def test_run_report_has_every_plot_non_blank(tmp_path):
    run = make_run(tmp_path / "run")
    rep = build_report(run)
    assert [p.spec.name for p in rep.plots] == [s.name for s in RUN_PLOTS]
    for p in rep.plots:
        assert p.reason is None, (p.spec.name, p.reason)
        assert_real_png(p.path.read_bytes(), p.spec.name)
    html = rep.html.read_text()
    embedded = re.findall(r'<figure id="([a-z_]+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert [n for n, _ in embedded] == [s.name for s in RUN_PLOTS]
    for name, b64 in embedded:
        assert_real_png(base64.b64decode(b64), name)
    md = rep.markdown.read_text()
    for s in RUN_PLOTS:
        assert f"(plots/{s.name}.png)" in md
    # provenance: config, seed, versions
    assert "tiny-random" in html and "torch" in html and "2.13.0" in html and "rate_limit=0.1" in html
    assert re.search(r"<th>seed</th><td>0</td>", html)
    # peak resident memory by phase (only the phases the run had)
    assert "<td>load 0.90 GB, evaluations 3.10 GB, RL 3.40 GB; the run 3.40 GB</td>" in html


def test_sweep_report_has_every_plot_non_blank(tmp_path):
    rep = build_report(make_sweep(tmp_path / "sweep"))
    assert [p.spec.name for p in rep.plots] == [s.name for s in SWEEP_PLOTS]
    for p in rep.plots:
        assert p.reason is None, (p.spec.name, p.reason)
        assert_real_png(p.path.read_bytes(), p.spec.name)
    md = rep.markdown.read_text()
    assert "| grpo | rate_limit=0.3 | 2/2 |" in md  # the aggregate table
    assert "| tool_rerl__none__s0 | tool_rerl | none | 0 | done |" in md  # the cells table


def test_crashed_run_still_gets_a_report_saying_what_is_missing(tmp_path):
    run = make_run(tmp_path / "run", reflection=False)
    (run / "summary.json").unlink()
    (run / "versions.json").unlink()
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 25, "phase": "tra')  # killed mid-write
    rep = build_report(run)
    html = rep.html.read_text()
    assert "summary.json: missing" in html and "versions.json: missing" in html
    assert "1 unreadable line(s)" in html
    by_name = {p.spec.name: p for p in rep.plots}
    assert by_name["reward_accuracy"].path is not None  # what exists is still drawn
    assert by_name["zero_variance"].path is not None
    assert by_name["importance_weights"].path is None
    assert "not recorded in this run" in by_name["importance_weights"].reason
    assert 'id="importance_weights"' in html and "not recorded in this run" in html


def test_run_folder_with_only_a_config(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("train: {seed: 3}\n")
    assert main(["report", str(d)]) == 0
    out = capsys.readouterr().out
    assert "report.html" in out and "not recorded in this run" in out
    html = (d / "report.html").read_text()
    assert "metrics.jsonl: missing" in html and "summary.json: missing" in html


def test_report_bad_paths_exit_2_naming_the_path(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "nope: no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "neither a run folder" in err and "Traceback" not in err


def test_temporal_stability_counts_previous_k_observations():
    # task a: all-correct in epochs 0, 1, 2 then not in 3; task b: correct in 0, not in 1
    rows = [{"step": i + 1, "epoch": e, "task_ids": ids, "group_all_correct": f}
            for i, (e, ids, f) in enumerate([(0, ["a", "b"], [True, True]), (1, ["a", "b"], [True, False]),
                                             (2, ["a"], [True]), (3, ["a", "b"], [False, None])])]
    k1, k2 = D.temporal_stability(rows)
    assert k1.epochs == [1, 2, 3] and k1.prob == [0.5, 1.0, 0.0] and k1.n == [2, 1, 1]
    assert k2.epochs == [2, 3] and k2.prob == [1.0, 0.0]
    assert D.temporal_stability([{"step": 1, "zero_var_ratio": 0.5}]) is None


def test_recovered_ratio_counts_retries_and_reflection(tmp_path):
    run = load_run(make_run(tmp_path / "r", reflection=True, fault_rate=0.0))
    rec = D.recovery(run)
    ratio, unit = rec.recovered_ratio
    r = rec.rollouts
    assert unit == "rollouts"
    assert ratio == pytest.approx((r["recovered_by_retry"] + r["recovered_by_reflection"])
                                  / (r["recovered_by_retry"] + r["failed"]))
    # an old run without rollout counts falls back to the ledger's tool calls
    run.summary.pop("recovery")
    run.rows = [{k: v for k, v in row.items() if not k.startswith("reflect/")} for row in run.rows]
    assert D.recovery(run).recovered_ratio == (pytest.approx(45 / 54), "tool calls")


def test_learning_curve_starts_rl_at_the_warm_up_result_not_the_base_model(tmp_path):
    """The held-out curve over RL steps starts from the accuracy after the warm-up (same step 0 as the
    base model's evaluation), so a report never credits RL with the warm-up's gain; the base model is
    kept apart."""
    path = make_run(tmp_path / "r", steps=8, acc_after=0.55)
    rows = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    rows.insert(1, {"step": 0, "phase": "eval", "test_after_warmup_accuracy": 0.45,
                    "test_after_warmup_stderr": 0.07})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    acc = D.accuracy(load_run(path))
    assert acc.base == pytest.approx(0.2)
    assert acc.test_steps == [0, 8] and acc.test_acc == pytest.approx([0.45, 0.55])
    assert acc.test_err[0] == pytest.approx(0.07)
    assert acc.val_steps == [8]
    # without the warm-up evaluation the curve starts at the base model, and base is not separate
    plain = D.accuracy(load_run(make_run(tmp_path / "p", steps=8, acc_after=0.55)))
    assert plain.base is None and plain.test_acc == pytest.approx([0.2, 0.55])


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def render(html_path) -> tuple[str, list[str]]:
    r = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                        "--v=0", "--dump-dom", html_path.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, [line for line in r.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian package 'chromium'; "
                                            "make test installs it when run as root)")
def test_report_renders_in_headless_chromium_without_console_errors(tmp_path):
    # positive control: Chromium's console logging reaches stderr on this machine
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><script>console.error("boom")</script></body></html>')
    _, console = render(bad)
    assert any("boom" in c for c in console), "console messages are not logged: the check would be vacuous"
    rep = build_report(make_sweep(tmp_path / "sweep"))
    run_rep = build_report(tmp_path / "sweep" / "cells" / "tool_rerl__rate_limit-0.1__s0")
    for r, specs in ((rep, SWEEP_PLOTS), (run_rep, RUN_PLOTS)):
        dom, console = render(r.html)
        assert console == [], console
        for s in specs:  # every figure made it into the rendered DOM with its image
            assert re.search(rf'<figure id="{s.name}"><img src="data:image/png;base64,', dom), s.name
