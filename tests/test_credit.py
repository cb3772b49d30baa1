"""Per-call credit (algo.credit: call): a negative advantage blames only the calls that made an answer wrong."""
from __future__ import annotations

import pytest
import torch

from reflrl import config as C
from reflrl import rollout as R
from reflrl.envs.types import Task, ToolCall
from reflrl.models import load_tokenizer
from reflrl.train.batch import make_batch
from reflrl.train.credit import blamed_spans, negative_credit, token_char_ends, trajectory_credit

from doubles import tiny_cfg
from test_trainer import scripted_trainer, trainable

GOLD = [ToolCall("get_stock_quote", {"symbol": "DIS"}), ToolCall("get_stock_quote", {"symbol": "JPM"})]


def call(symbol: str) -> str:
    return '<tool_call>\n{"name": "get_stock_quote", "arguments": {"symbol": "%s"}}\n</tool_call>' % symbol


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


def blamed_text(text: str, tok, gold=GOLD) -> str | None:
    """The characters of ``text`` + end of turn that call credit blames (None: all of them)."""
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    spans = blamed_spans(tok.decode(ids, skip_special_tokens=False), gold)
    if spans is None:
        return None
    w = negative_credit(ids, token_char_ends(ids, tok), spans)
    assert len(w) == len(ids)
    return "".join(tok.decode([i], skip_special_tokens=False) for i, x in zip(ids, w) if x)


def test_a_missing_call_blames_only_the_end_of_the_turn(tok):
    assert blamed_text(call("DIS"), tok) == tok.eos_token


def test_a_wrong_value_blames_that_call_content_not_its_markup_nor_the_right_call(tok):
    got = blamed_text(call("DIS") + "\n" + call("JPX"), tok)
    assert "JPX" in got and "DIS" not in got
    assert "<tool_call>" not in got and "</tool_call>" not in got and tok.eos_token not in got


def test_a_call_beyond_the_gold_ones_is_blamed_whole(tok):
    got = blamed_text(call("JPM") + "\n" + call("DIS") + "\n" + call("DIS"), tok)
    assert got.strip() == call("DIS")  # order-free match: the third block is the extra one


def test_no_call_block_or_another_format_blames_everything(tok):
    assert blamed_text("I cannot help with that.", tok) is None
    assert blamed_spans('get_stock_quote(symbol="DIS")', GOLD, "pythonic") is None


def test_trajectory_credit_follows_the_response_tokens_and_make_batch_applies_it(tok):
    task = Task(id="t", query="Quote DIS and JPM", tools=[], gold=[list(GOLD)])
    ids = tok(call("DIS") + "\n" + call("JPX"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    t = R.Trajectory(task=task, group=0, prompt_ids=[1, 2, 3], response_ids=ids, loss_mask=[1] * len(ids),
                     old_logprobs=[-0.5] * len(ids), texts=["x"], turns=1)
    w = trajectory_credit(t, tok)
    assert w is not None and 0 < sum(w) < len(ids)
    b = make_batch([t], [-2.0], pad_id=0, token_weights=[w])
    assert b.advantages[0].tolist() == [-2.0 * x for x in w]
    assert b.response_mask[0].tolist() == [1] * len(ids)  # the token-mean denominator keeps every token
    with pytest.raises(ValueError, match="token_weights"):
        make_batch([t], [-2.0], pad_id=0, token_weights=[w[:-1]])


def test_config_rejects_an_unknown_credit():
    with pytest.raises(C.ConfigError, match="algo.credit"):
        C.load_config(None, ["algo.credit=token"])


def test_call_credit_changes_the_update_and_logs_what_it_blames(tmp_path):
    """One step of the scripted trainer (right answers for even samples, a wrong argument for odd ones),
    with sequence and with call credit from the same seed: call credit blames only part of the wrong
    answers' tokens and so moves the parameters differently."""
    after, rows = {}, {}
    for credit in ("sequence", "call"):
        cfg = tiny_cfg(tmp_path / credit, **{"train.steps": 1, "train.save_every": 0, "algo.credit": credit})
        tr = scripted_trainer(cfg, tmp_path / credit / "run")
        try:
            rows[credit] = tr.train_step()
            after[credit] = trainable(tr.model)
        finally:
            tr.close()
    assert "credit_blamed_frac" not in rows["sequence"]
    assert 0.0 < rows["call"]["credit_blamed_frac"] < 1.0
    assert any(not torch.equal(after["sequence"][n], after["call"][n]) for n in after["call"])
