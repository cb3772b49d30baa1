"""Run size and report: per-benchmark --limit/--seeds, the subset/full modes, the printed plan and
its estimate (the default three-benchmark run fits 20 minutes at the stored rates), progress lines
with an ETA off a terminal, the paper's numbers beside the model's in report.md, and the CLI on the
shipped data without --data-dir (manifest: origin and hash of every data file)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from reflrl.eval import paper, plan, sources
from reflrl.eval.backends import Decoding
from reflrl.eval.run import EvalOptions, drive, prepare, run_eval
from reflrl.eval.tables import markdown_report, rows_with_paper


class EchoBackend:
    """Test double: answers every prompt with a fixed text and counts the calls."""

    name = "echo-double"
    batch_size = 1

    def __init__(self):
        self.calls = []

    def chat(self, conversations, decoding, seed, desc=""):
        self.calls.append((len(conversations), seed))
        return ["Action: finish\nAction Input: {}"] * len(conversations)

    def describe(self):
        return {"kind": "double", "model": self.name, "weights_sha256": None}


def test_per_benchmark_limits_and_seeds():
    assert plan.parse_per_benchmark("7", "--limit") == (7, {})
    assert plan.parse_per_benchmark("rotbench=3, bfcl=2", "--limit") == (None, {"rotbench": 3, "bfcl": 2})
    for bad, msg in (("0", "at least 1"), ("x", "whole number"), ("rotbench=0", "at least 1"),
                     ("rotbnech=2", "unknown benchmark 'rotbnech'"), ("bfcl=two", "not bench=N")):
        with pytest.raises(ValueError, match=msg):
            plan.parse_per_benchmark(bad, "--limit")
    limits, seeds, mode = plan.sizes(["rotbench", "bfcl"])
    assert mode == "subset" and limits == {b: plan.DEFAULT_LIMIT[b] for b in ("rotbench", "bfcl")}
    assert seeds == {b: plan.DEFAULT_SEEDS[b] for b in ("rotbench", "bfcl")}
    assert plan.sizes(["rotbench", "bfcl"], full=True) == ({"rotbench": None, "bfcl": None},
                                                         {"rotbench": 3, "bfcl": 3}, "full")
    limits, seeds, mode = plan.sizes(["rotbench", "bfcl"], limit="bfcl=2", seeds="1")
    assert mode == "custom" and limits == {"rotbench": plan.DEFAULT_LIMIT["rotbench"], "bfcl": 2}
    assert seeds == {"rotbench": 1, "bfcl": 1}
    with pytest.raises(ValueError, match="not both"):
        plan.sizes(["bfcl"], limit=3, full=True)


def test_default_run_is_a_subset_that_fits_twenty_minutes():
    """The acceptance command's default size, from the shipped data (no model loaded)."""
    opts = EvalOptions(benchmarks=["rotbench", "taskbench", "bfcl"], limits=dict(plan.DEFAULT_LIMIT),
                       seeds_by_benchmark={b: list(range(n)) for b, n in plan.DEFAULT_SEEDS.items()},
                       mode="subset")
    prep = prepare(opts, log=lambda m: None)
    p = prep.plan
    assert p.is_subset and p.estimate_s() <= 20 * 60
    assert p.samples("rotbench") == 5 * plan.DEFAULT_LIMIT["rotbench"] and p.available("rotbench") == 840
    assert p.available("taskbench") is None  # an excerpt of upstream's files
    assert p.samples("bfcl") == 8 * plan.DEFAULT_LIMIT["bfcl"]
    text = p.text()
    assert "SUBSET" in text and "--full runs everything" in text
    g = p.generations("rotbench")
    assert f"{p.samples('rotbench')} of 840 samples x {plan.DEFAULT_SEEDS['rotbench']} seeds = {g} generations" in text
    est = plan.SETUP_SECONDS + sum(p.generations(b) * plan.SECONDS_PER_SAMPLE[b] for b in ("rotbench", "taskbench", "bfcl"))
    assert p.estimate_s() == pytest.approx(est)
    d = p.to_dict()
    assert d["subset"] is True and d["benchmarks"]["rotbench"]["units"]["rotbench/clean"] == {
        "samples": plan.DEFAULT_LIMIT["rotbench"], "available": 105}


def test_progress_lines_off_a_terminal_show_rate_and_eta(monkeypatch):
    import sys

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    backend = EchoBackend()
    opts = EvalOptions(benchmarks=["rotbench"], limits={"rotbench": 12}, seeds=[0, 1], levels=["clean"], chunk=1,
                       decoding=Decoding(temperature=0.7))
    res = run_eval(backend, opts, log=lambda m: None)
    lines = err.getvalue().splitlines()
    assert all(l.startswith("[reflrl] ") for l in lines if l.strip())
    assert any("rotbench seed 0 " in l and "s/sample" in l and "phase ETA" in l and "run ends in ~" in l
               for l in lines), lines
    assert any("rotbench seed 1 done: 12/12 samples" in l for l in lines)
    assert len(backend.calls) == 24 and len({s for _, s in backend.calls}) == 24  # a seed per call
    t = res["timing"]
    assert [p["samples"] for p in t["phases"]] == [12, 12] and "rotbench" in t["seconds_per_sample"]


def test_drive_in_chunks_reports_finished_episodes():
    def ep(k):
        text = yield [{"role": "user", "content": str(k)}]
        return text

    done = []
    backend = EchoBackend()
    out = drive(backend, [ep(k) for k in range(5)], Decoding(), 3, "native", chunk=2, on_done=done.append)
    assert len(out) == 5 and done == [2, 2, 1] and [n for n, _ in backend.calls] == [2, 2, 1]


def test_paper_numbers_are_consistent_with_the_papers_own_averages():
    """Table 2's "Internal + IS" columns are the averages of Table 1's +CoT+IS rows (RoTBench: Par. and
    Cont.; TaskBench: the four F1): a transcription error in that column would show here."""
    t1 = paper.table1()
    table2 = {"Qwen2.5-7B": {"clean": 53.33, "heavy": 34.29, "medium": 49.05, "slight": 50.48, "union": 40.95,
                             "huggingface": 44.26, "multimedia": 59.64},
              "Llama3.1-8B": {"clean": 38.57, "heavy": 21.67, "medium": 38.81, "slight": 32.38, "union": 30.96,
                              "huggingface": 43.73, "multimedia": 57.29}}
    for model, cols in table2.items():
        row = t1[(model, "+CoT+IS")]
        for sub, expected in cols.items():
            vals = [v for (b, s, _), v in row.items() if s == sub]
            assert len(vals) in (2, 4)
            assert sum(vals) / len(vals) == pytest.approx(expected, abs=0.011), (model, sub)
    assert paper.reference("rotbench", "clean", "content_filling") == [20.00, 17.14, 51.43, 40.00]
    assert paper.reference("taskbench", "dailylifeapis", "node_f1") == [None] * 4
    assert len(t1) == 16 and all(len(v) == 18 for v in t1.values())


def test_report_puts_the_papers_numbers_beside_the_models():
    stat = {"mean": 12.5, "std": 1.0, "values": [11.5, 13.5]}
    result = {"manifest": {"model": {"model": "m", "kind": "double"}, "seeds": [0, 1],
                           "decoding": {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 256},
                           "multi_turn_template": "native", "keep_thinking_history": True,
                           "limit_per_subset": {"rotbench": 8},
                           "run_size": {"subset": True, "benchmarks": {"rotbench": {"samples": 8, "available": 105,
                                                                                    "seeds": 2}}}},
              "results": {"rotbench": {"clean": {"tool_selection": stat, "parameter_identification": stat,
                                                 "content_filling": stat}},
                          "bfcl_summary": {"non_live": stat, "groups_used": ["non_live"]}, "bfcl": {}}}
    md = markdown_report(result)
    assert "| Benchmark | Subset | Metric | Value | Qwen2.5-7B Base | Llama3.1-8B Base | Qwen2.5-7B Tool-ReRL " \
           "| Llama3.1-8B Tool-ReRL |" in md
    assert "| RoTBench | CLE | Cont. | 12.50 ± 1.00 | 20.00 | 17.14 | 51.43 | 40.00 |" in md
    assert "| RoTBench | CLE | TS | 12.50 ± 1.00 | – | – | – | – |" in md
    assert "Non-Live 86.25, Live 78.68" in md and "a SUBSET" in md and "rotbench 8 of 105 samples x 2 seeds" in md
    assert rows_with_paper(result)[0][:4] == ("RoTBench", "CLE", "TS", "12.50 ± 1.00")


def test_cli_runs_on_the_shipped_data_without_data_dir(tmp_path, monkeypatch, capsys):
    from reflrl.cli import main

    monkeypatch.delenv("REFLRL_BENCH_DATA", raising=False)
    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # no network: nothing may be downloaded
    assert main(["eval", "rotbench", "taskbench", "bfcl", "sealtools", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "a SUBSET of each benchmark" in err and "estimated" in err and f"sealtools {2 * plan.DEFAULT_LIMIT['sealtools']} of 1354 samples" in err
    out = tmp_path / "ev"
    rc = main(["eval", "rotbench", "taskbench", "sealtools", "--model", "tiny-random", "--dtype", "float32",
               "--limit", "1", "--seeds", "1", "--levels", "clean", "--domains", "huggingface",
               "--max-new-tokens", "4", "--out", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    assert "rotbench  1 of 105 samples x 1 seed = 1 generations" in cap.err and "[reflrl] " in cap.err
    man = json.loads((out / "manifest.json").read_text())
    assert man["run_size"]["subset"] is True and man["run_size"]["mode"] == "custom"
    entry = man["data"]["reflrl/benchdata/rotbench/first_turn/clean.json.gz"]
    assert entry["origin"]["commit"] == sources.ROTBENCH.commit and entry["origin"]["license"] == "Apache-2.0"
    assert entry["content_sha256"] == entry["origin"]["upstream_sha256"]
    tb = man["data"]["reflrl/benchdata/taskbench/data_huggingface/data.json.gz"]["origin"]
    assert tb["repository"] == "laminair/JARVIS" and tb["part"].startswith("first 45 records")
    assert "reflrl/benchdata/seal-tools/tool.jsonl.gz" in man["data"]
    md = (out / "report.md").read_text()
    assert "Qwen2.5-7B Base" in md and "| RoTBench | CLE | Par. |" in md
    assert not (tmp_path / "cache" / "benchdata").exists()
    # --full needs TaskBench's whole files: without a network, one error naming --data-dir and the layout
    monkeypatch.setenv(sources.ENV_BASE, "https://127.0.0.1:9")
    assert main(["eval", "taskbench", "--full", "--domains", "multimedia", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "reflrl eval: error:" in err and "cannot connect" in err and "--data-dir DIR" in err
    assert "DIR/taskbench/data_<domain>/data.json" in err
