"""End to end: `reflrl eval` with the tiny random model writes results, manifest, report and
predictions; compare works; a backend double checks the multi-turn driver."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reflrl.eval import bfcl as B
from reflrl.eval.backends import Decoding, apply_template
from reflrl.eval.compare import compare, format_comparison, welch
from reflrl.eval.run import EvalOptions, drive, run_eval
from reflrl.eval.data import DataError

DATA = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


class GoldBackend:
    """Test double: answers BFCL prompts with the gold calls of the entry it is told about."""

    name = "gold-double"

    def __init__(self, answers):
        self.answers = answers  # callable(messages) -> text
        self.calls = 0

    def chat(self, conversations, decoding, seed, desc=""):
        self.calls += 1
        return [self.answers(c) for c in conversations]

    def describe(self):
        return {"kind": "double", "model": self.name, "weights_sha256": None}


def test_multi_turn_driver_with_gold_answers_scores_correct():
    entries = B.load_entries("multi_turn_base", limit=2)
    by_first_user = {e.prompt["question"][0][-1]["content"]: e for e in entries}

    def answer(msgs):
        user_turns = [m for m in msgs if m["role"] == "user"]
        e = by_first_user[user_turns[0]["content"]]
        turn = len(user_turns) - 1
        if msgs[-1]["role"] == "tool":  # already executed this turn's calls: finish the turn
            return "Done."
        gold = e.ground_truth[turn]
        if any("(" in c and "=" not in c.split("(", 1)[1] and not c.endswith("()") for c in gold):
            return "Done."
        return "[" + ", ".join(gold) + "]"

    backend = GoldBackend(answer)
    eps = [B.multi_turn_episode(e) for e in entries]
    results = drive(backend, eps, Decoding(temperature=0), seed=0, template="native")
    assert len(results) == 2 and all(len(r) == len(e.ground_truth) for r, e in zip(results, entries))
    # entry 0's gold has a positional-argument call that bfcl's decoder drops; entry 1 is all keywords
    verdicts = [B.score_multi_turn(e, r)["valid"] for e, r in zip(entries, results)]
    ref = [all("=" in c or c.endswith("()") for t in e.ground_truth for c in t) for e in entries]
    assert verdicts == ref
    assert backend.calls >= 2 * max(len(e.ground_truth) for e in entries)


def test_context_template_packs_history():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "tool", "name": "f()", "content": "r1"}]
    packed = apply_template(msgs, "context")
    assert [m["role"] for m in packed] == ["system", "user"]
    assert "u1" in packed[1]["content"] and "a1" in packed[1]["content"] and "r1" in packed[1]["content"]
    assert apply_template(msgs, "native") == msgs


def test_eval_end_to_end_tiny_model(tmp_path):
    from reflrl.eval.backends import LocalBackend

    backend = LocalBackend("tiny-random", dtype="float32", batch_size=4)
    opts = EvalOptions(benchmarks=["rotbench", "bfcl", "sealtools", "taskbench"], data_dir=DATA, limit=1,
                       seeds=[0, 1], decoding=Decoding(temperature=0.7, max_new_tokens=4),
                       categories=["simple", "irrelevance"], levels=["clean"])
    out = tmp_path / "run"
    res = run_eval(backend, opts, out_dir=out, log=lambda m: None)
    for f in ("results.json", "manifest.json", "report.md", "predictions.jsonl"):
        assert (out / f).is_file(), f
    man = json.loads((out / "manifest.json").read_text())
    assert man["seeds"] == [0, 1] and man["decoding"]["temperature"] == 0.7
    assert man["model"]["weights_sha256"] and man["multi_turn_template"] == "native"
    assert man["keep_thinking_history"] is True and man["packages"]["bfcl-eval"]
    assert man["system_prompts"]["bfcl/simple_python"]["template_sha256"]
    assert "data-dir/rotbench/first_turn/clean.json" in man["data"]
    assert "bfcl_eval/data/BFCL_v4_simple_python.json" in man["data"]
    r = res["results"]
    assert r["rotbench"]["clean"]["content_filling"]["values"] == [0.0, 0.0]
    assert r["bfcl"]["irrelevance"]["accuracy"]["mean"] is not None
    assert res["skipped"] == []
    for dom in ("huggingface", "multimedia", "dailylifeapis"):  # both gold schemas' domains, scored
        tb = r["taskbench"][dom]
        assert len(tb["strict"]["node_f1"]["values"]) == 2 and tb["n"] == 1
    assert man["system_prompts"]["taskbench/huggingface"]["template_sha256"]
    assert "data-dir/taskbench/data_dailylifeapis/data.json" in man["data"]
    preds = [json.loads(l) for l in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 2 * 7 and {p["seed"] for p in preds} == {0, 1}
    md = (out / "report.md").read_text()
    assert "| RoTBench | CLE | Cont. |" in md and "| BFCL | simple_python | Acc. |" in md
    assert "| TaskBench | DL | n_f1 |" in md
    # the same model compared with itself: no metric beyond noise, no manifest warning
    c = compare(res, res)
    assert not c["manifest_differences"] and all(m["exceeds_noise"] in (None, False) for m in c["metrics"].values())


def test_compare_flags_real_differences_and_manifest_changes():
    def result(values, temp, model):
        return {"kind": "reflrl-eval-results", "manifest": {"model": {"model": model}, "seeds": [0, 1, 2],
                                                            "decoding": {"temperature": temp}},
                "results": {"bfcl": {"simple_python": {"accuracy": {"mean": 0, "std": 0, "values": values}}}}}

    a = result([50.0, 52.0, 51.0], 0.7, "base")
    b = result([70.0, 71.0, 69.5], 0.7, "trained")
    c = compare(a, b)
    m = c["metrics"]["bfcl.simple_python.accuracy"]
    assert m["exceeds_noise"] is True and m["diff"] == pytest.approx(19.166666, rel=1e-4)
    assert c["manifest_differences"] == []
    noisy = result([40.0, 60.0, 55.0], 0.9, "trained")
    c2 = compare(a, noisy)
    assert c2["metrics"]["bfcl.simple_python.accuracy"]["exceeds_noise"] is False
    assert c2["manifest_differences"] == ["decoding.temperature"]
    assert "WARNING" in format_comparison(c2)
    assert welch([1.0], [2.0])["exceeds_noise"] is None


def test_cli_rejects_bad_input(tmp_path, capsys):
    from reflrl.cli import main

    assert main(["eval", "bfcl", "--model", "tiny-random", "--categories", "simpel"]) == 2
    assert "unknown BFCL category 'simpel'" in capsys.readouterr().err
    assert main(["eval", "rotbench", "--model", "tiny-random", "--full", "--limit", "3"]) == 2
    assert "give --full or --limit, not both" in capsys.readouterr().err
    assert main(["eval", "rotbench", "--model", "tiny-random", "--limit", "rotbnech=3"]) == 2
    assert "unknown benchmark 'rotbnech'" in capsys.readouterr().err
    assert main(["eval", "rotbench", "--model", "tiny-random", "--seeds", "0"]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err
    assert main(["eval", "rotbench", "--data-dir", str(tmp_path), "--dry-run"]) == 2
    assert "no RoTBench files under" in capsys.readouterr().err
    assert main(["eval", "nope", "--model", "x"]) == 2
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_real_model_limit_1(tmp_path, capsys):
    """The acceptance command, shrunk: the embedded SmolLM2 (float32) on one entry of a RoTBench level,
    of TaskBench's huggingface domain (the shortest tool list) and of a BFCL category, 2 seeds (the full command takes far longer here)."""
    from reflrl.cli import main

    out = tmp_path / "ev"
    rc = main(["eval", "rotbench", "taskbench", "bfcl", "--model", "smollm2-135m-instruct", "--limit", "1",
               "--seeds", "2", "--data-dir", str(DATA), "--levels", "clean", "--categories", "simple",
               "--domains", "huggingface",
               "--max-new-tokens", "24", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["manifest"]["model"]["model"] == "smollm2-135m-instruct"
    assert len(res["results"]["rotbench"]["clean"]["content_filling"]["values"]) == 2
    assert set(res["results"]["bfcl"]) == {"simple_python"}
    assert set(res["results"]["taskbench"]) == {"huggingface"}
    assert len(res["results"]["bfcl"]["simple_python"]["accuracy"]["values"]) == 2
    assert "| BFCL | Overall | Acc. |" in capsys.readouterr().out


class _FakeCompletions:
    def __init__(self):
        self.requests = []

    def create(self, **kw):
        import types

        self.requests.append(kw)
        text = f"echo {kw['messages'][-1]['content'][:20]}"
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=types.SimpleNamespace(content=text))])


class _FakeClient:
    def __init__(self):
        import types

        self.chat = types.SimpleNamespace(completions=_FakeCompletions())
        self.models = types.SimpleNamespace(retrieve=lambda name: (_ for _ in ()).throw(RuntimeError("no")))


def test_endpoint_backend_sends_decoding_and_converts_tool_messages():
    from reflrl.eval.backends import EndpointBackend

    client = _FakeClient()
    be = EndpointBackend("http://127.0.0.1:9/v1", "served-model", client=client, concurrency=2)
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
    convs.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": "[f(a=1)]"},
                  {"role": "tool", "name": "f(a=1)", "content": "42"}])
    outs = be.chat(convs, Decoding(temperature=0.5, top_p=0.9, max_new_tokens=7), seed=3)
    assert outs[:5] == [f"echo q{i}" for i in range(5)]
    reqs = client.chat.completions.requests
    assert len(reqs) == 6 and {r["seed"] for r in reqs} == {3} and {r["max_tokens"] for r in reqs} == {7}
    tool_req = next(r for r in reqs if len(r["messages"]) == 3)
    assert tool_req["messages"][2]["role"] == "user" and "42" in tool_req["messages"][2]["content"]
    d = be.describe()
    assert d["kind"] == "endpoint" and d["model"] == "served-model" and d["server_model"].startswith("unavailable")


def test_run_checkpoint_resolution(tmp_path):
    from reflrl.eval.backends import run_checkpoint

    run = tmp_path / "run"
    with pytest.raises(DataError, match="no checkpoints"):
        run_checkpoint(run)
    for step in (5, 12):
        ck = run / "checkpoints" / f"step_{step:06d}"
        (ck / "model").mkdir(parents=True)
        (ck / "state.json").write_text("{}")
        (ck / "trainable.pt").write_bytes(b"")  # a checkpoint counts with state.json and trainable.pt
        (ck / "model" / "config.json").write_text("{}")
    assert run_checkpoint(run) == run / "checkpoints" / "step_000012" / "model"
    assert run_checkpoint(run / "checkpoints" / "step_000005" / "model").name == "model"


def test_scorers_never_raise_on_hostile_outputs():
    """Outputs that break parsers are scored wrong and counted, never raise."""
    from hypothesis import given, settings, strategies as st

    from reflrl.eval import rotbench as R, sealtools as S, taskbench as T

    rot = R.load_level(DATA, "clean", limit=1)
    td = T.load_tool_desc(DATA, "huggingface")
    tb = [T.TaskItem("t", "huggingface", "r", T.normalize_gold(
        {"id": "t", "task_nodes": [{"task": "Translation", "arguments": ["hi"]}], "task_links": []}, Path("f"), 0))]
    seal = [S.SealItem("s", "q", [{"api": "A", "parameters": {"x": "1"}}], [])]
    bf = B.load_entries("simple_python", limit=1) + B.load_entries("irrelevance", limit=1)
    fixed = ["[" * 5000, "{" * 5000, "Action: x\nAction Input: " + "[" * 3000, "\x00\udcff", "",
             '{"task_nodes": [{"task": 5, "arguments": [{"a": 1}]}]}', '[{"api": "A", "parameters": {"x": [1]}, "responses": 1}]',
             "[f(x=1)] " * 2000, "[calculate_triangle_area(base=1e308*1e308, height=1)]"]

    def check(text):
        R.score(rot, [text])
        T.score(tb, [text], td, "huggingface")
        S.score(seal, [text])
        for e in bf:
            B.score_single(e, text)

    for text in fixed:
        check(text)

    @settings(max_examples=40, deadline=None)
    @given(st.text(alphabet=st.sampled_from(list("[](){}=,'\"abc123 :\nAction Input.-*/")), max_size=80))
    def fuzz(text):
        check(text)

    fuzz()


def test_runner_with_gold_answers_scores_perfectly(tmp_path):
    """A backend double that answers every prompt with its gold answer gets full marks through the
    whole pipeline (prompting, driver, scoring, aggregation) on RoTBench, TaskBench, Seal-Tools, BFCL."""
    from reflrl.eval import rotbench as R, sealtools as S, taskbench as T

    data = tmp_path / "data"
    shutil.copytree(DATA / "rotbench", data / "rotbench")
    shutil.copytree(DATA / "seal-tools", data / "seal-tools")
    shutil.copytree(DATA / "taskbench", data / "taskbench")
    tb = data / "taskbench" / "data_huggingface"
    gold_graphs = [
        {"id": "g1", "user_request": "describe example.jpg aloud", "type": "chain", "task_steps": ["a", "b"],
         "task_nodes": [{"task": "Image-to-Text", "arguments": ["example.jpg"]},
                        {"task": "Text-to-Speech", "arguments": ["<node-0>"]}],
         "task_links": [{"source": "Image-to-Text", "target": "Text-to-Speech"}]},
        {"id": "g2", "instruction": "translate hello", "tool_steps": "[]",
         "tool_nodes": json.dumps([{"task": "Translation", "arguments": ["hello"]}]), "tool_links": "[]"}]
    (tb / "data.json").write_text("".join(json.dumps(g) + "\n" for g in gold_graphs))

    limit = 3
    answers: dict[str, str] = {}
    for lv in R.LEVELS:
        for it in R.load_level(data, lv, limit):
            answers[it.messages[-1]["content"] + it.messages[0]["content"]] = it.answers[0]
    td = T.load_tool_desc(data, "huggingface")
    for it in T.load_domain(data, "huggingface"):
        g = it.gold
        answers[T.prompt_messages(it, td, "huggingface")[0]["content"]] = json.dumps({"task_steps": g["task_steps"], "task_nodes": g["task_nodes"],
                                          "task_links": g["task_links"]})
    tools = S.load_tools(data)
    for it in S.load_split(data / "seal-tools" / "dev_subset.jsonl", tools, limit):
        answers[it.query] = json.dumps(it.calling)
    for e in B.load_entries("simple_python", limit) + B.load_entries("parallel", limit):
        answers[e.prompt["question"][0][-1]["content"]] = B.gold_output(e.ground_truth, e.check_prompt["function"])

    def answer(msgs):
        key = msgs[-1]["content"]
        return answers.get(key + msgs[0]["content"], answers.get(key, "no idea"))

    res = run_eval(GoldBackend(answer), EvalOptions(
        benchmarks=["rotbench", "taskbench", "sealtools", "bfcl"], data_dir=data, limit=limit, seeds=[0, 1],
        categories=["simple_python", "parallel"], domains=["huggingface"]), out_dir=tmp_path / "out", log=lambda m: None)
    r = res["results"]
    rot_expected = {lv: R.score(R.load_level(data, lv, limit), [i.answers[0] for i in R.load_level(data, lv, limit)])[0]
                    for lv in R.LEVELS}  # gold answers with empty inputs are wrong upstream too
    for lv in R.LEVELS:
        assert r["rotbench"][lv]["tool_selection"]["mean"] == rot_expected[lv]["tool_selection"]
    assert r["taskbench"]["huggingface"]["strict"]["node_f1"]["mean"] == 100.0
    assert r["taskbench"]["huggingface"]["upstream"]["arg_value_f1"]["mean"] == 100.0
    assert r["sealtools"]["dev_subset"]["param_f1"]["mean"] == 100.0
    assert r["bfcl"]["simple_python"]["accuracy"]["values"] == [100.0, 100.0]
    assert r["bfcl_summary"]["non_live"]["mean"] == 100.0


def test_driver_survives_a_broken_episode():
    def broken():
        yield [{"role": "user", "content": "x"}]
        raise KeyError("boom")

    def fine():
        text = yield [{"role": "user", "content": "y"}]
        return text

    errors: list[str] = []
    out = drive(GoldBackend(lambda m: "ok " + m[-1]["content"]), [broken(), fine()], Decoding(), 0, "native",
                errors=errors)
    assert out == [None, "ok y"] and len(errors) == 1 and "KeyError" in errors[0]


def test_reflrl_cli_eval_compare(tmp_path, capsys):
    from reflrl.cli import main

    def write(name, values, temp):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({
            "kind": "reflrl-eval-results", "manifest": {"model": {"model": name}, "decoding": {"temperature": temp}},
            "results": {"rotbench": {"clean": {"content_filling": {"mean": 0, "std": 0, "values": values}}}}}))
        return str(d)

    a = write("base", [10.0, 12.0, 11.0], 0.7)
    b = write("tuned", [30.0, 31.0, 29.0], 0.6)
    assert main(["eval", "compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "rotbench.clean.content_filling" in out and "beyond seed noise" in out
    assert "WARNING" in out and "decoding.temperature" in out


def test_eval_on_a_run_folder_then_compare(tmp_path, capsys):
    """`reflrl eval ... --model RUN_DIR` evaluates the run's final checkpoint (saved by RunLog as
    training saves it); `reflrl eval compare` then sets it against the base model."""
    import torch

    from reflrl.cli import main
    from reflrl.models import load_model
    from reflrl.runlog import RunLog

    run = tmp_path / "run"
    log = RunLog(run, {"model": {"name": "tiny-random"}}, tensorboard=False)
    model, tok = load_model("tiny-random", dtype="float32", trainable="all")
    for step in (2, 4):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)  # "training": each checkpoint has other weights
        log.save_checkpoint(step, model=model, tokenizer=tok, optimizer=None, state={"step": step}, keep_last=2)
    log.close()
    common = ["bfcl", "--categories", "simple", "--limit", "2", "--seeds", "2", "--max-new-tokens", "3",
              "--dtype", "float32", "--batch-size", "2"]
    assert main(["eval", *common, "--model", "tiny-random", "--out", str(tmp_path / "base")]) == 0
    assert main(["eval", *common, "--model", str(run), "--out", str(tmp_path / "trained")]) == 0
    man = json.loads((tmp_path / "trained" / "manifest.json").read_text())
    assert man["model"]["source"] == f"run:{run}" and man["model"]["model"].endswith("step_000004/model")
    assert man["model"]["dtype"] == "float32"
    base = json.loads((tmp_path / "base" / "manifest.json").read_text())
    assert base["model"]["weights_sha256"] != man["model"]["weights_sha256"]
    capsys.readouterr()
    assert main(["eval", "compare", str(tmp_path / "base"), str(tmp_path / "trained")]) == 0
    out = capsys.readouterr().out
    assert "bfcl.simple_python.accuracy" in out and "B = " in out and "WARNING" not in out
