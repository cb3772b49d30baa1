"""Per-call credit for wrong answers (``algo.credit: call``): which tokens a negative advantage blames.

GRPO gives every token of a rollout its sequence advantage. For a wrong parallel answer that is
mostly right (two of three calls match the gold answer, or every call matches but one is missing),
that pushes down the right calls' tokens as hard as the wrong one's. On this repository's recipe
(AVX512-BF16 CPU, bfloat16, seed 0), 8 GRPO steps took the held-out parallel answers from 3 of 24
right to 0. With ``call`` credit a NEGATIVE advantage applies only to the tokens that made the answer
wrong, judged against the task's gold calls (the reward's own ground truth; no extra model):

* the content of each ``<tool_call>`` block whose call matches no unused gold call (wrong tool,
  wrong/missing/extra argument, unparseable block); the whole block, markup included, when it is a
  call beyond the gold answer's count (making it at all was the mistake);
* the tokens after the last block (the end of the turn) when the answer makes fewer calls than
  the gold answer: stopping there was the mistake;
* every token when the answer has no block at all, is not in the hermes format, or has more than
  one assistant turn (multi-turn credit is not defined here).

Positive advantages are unchanged (every token of a right answer is right), so a group's advantages
no longer sum to zero: this is a token-level credit assignment in the spirit of process supervision,
at the granularity the exact-match reward is defined on (one call). It is a design decision of
reflrl for multi-call answers, off by default (``sequence``: GRPO as written): from the same three
warm-ups per precision it ended RL at 47.9 / 43.8 / 41.7% against 37.5 / 43.8 / 39.6% in bfloat16, but
at 43.8 / 43.8 / 39.6% against 50.0 / 43.8 / 39.6% in float32 (README, "What was tried").
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Sequence

from reflrl.envs.parsing import parse
from reflrl.envs.rewards import call_key
from reflrl.envs.types import ToolCall

_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def token_char_ends(token_ids: Sequence[int], tokenizer: Any) -> list[int]:
    """For each token, the length of the decoded text of the tokens up to and including it (special
    tokens kept, so ``<tool_call>`` markup counts): token i covers characters [ends[i-1], ends[i])."""
    ends, prev = [], 0
    for i in range(len(token_ids)):
        n = len(tokenizer.decode(list(token_ids[: i + 1]), skip_special_tokens=False))
        prev = max(prev, n)
        ends.append(prev)
    return ends


def blamed_spans(text: str, gold: Sequence[ToolCall], fmt: str = "hermes") -> list[tuple[int, int]] | None:
    """Character spans of ``text`` that a negative advantage should blame; None = the whole answer.

    Each ``<tool_call>`` block is parsed on its own and matched against the gold calls as a multiset
    (first come, first served); unmatched blocks are blamed, and so is the tail after the last block
    when fewer calls were made than the gold answer has."""
    if fmt != "hermes":
        return None
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return None
    left = Counter(call_key(c) for c in gold)
    spans: list[tuple[int, int]] = []
    made = 0
    for b in blocks:
        p = parse(b.group(0), fmt)
        calls = list(p.calls) if p.ok else []
        due = made < len(gold)  # the gold answer has a call here: opening a block was right
        made += max(1, len(calls))
        keys = [call_key(c) for c in calls]
        if calls and all(left[k] > 0 for k in keys) and len(set(keys)) == len(keys):
            for k in keys:
                left[k] -= 1
        elif due:  # a wrong call where one was due: blame its content, not the <tool_call> markup
            body = b.group(0)
            a = b.start() + len("<tool_call>")
            z = b.end() - (len("</tool_call>") if body.endswith("</tool_call>") else 0)
            spans.append((a, max(a, z)))
        else:  # a call beyond the gold ones: the whole block is the mistake
            spans.append((b.start(), b.end()))
    if made < len(gold):
        spans.append((blocks[-1].end(), len(text)))
    return spans


def negative_credit(token_ids: Sequence[int], text_ends: Sequence[int], spans: list[tuple[int, int]] | None
                    ) -> list[float]:
    """1.0 on the tokens that overlap a blamed span (all tokens when ``spans`` is None), else 0.0.

    ``text_ends``: :func:`token_char_ends`. An empty span at the end of the text (an answer that
    stopped right after its last block, without an end-of-turn token) blames the last token."""
    if spans is None:
        return [1.0] * len(token_ids)
    out = []
    start = 0
    for end in text_ends:
        out.append(1.0 if any(start < b and end > a for a, b in spans) else 0.0)
        start = end
    if out and any(a == b and a >= start for a, b in spans):  # an empty tail: the answer stopped right there
        out[-1] = 1.0
    return out


def trajectory_credit(traj: Any, tokenizer: Any, fmt: str = "hermes") -> list[float] | None:
    """Per-response-token weights of a trajectory's NEGATIVE advantage under ``call`` credit (length
    R, 0 on observation tokens as the loss mask has them), or None when every token is blamed."""
    if traj.turns > 1 or len(traj.texts) != 1 or not traj.task.gold:
        return None
    ids = list(traj.response_ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    spans = blamed_spans(text, list(traj.task.gold[0]), fmt)
    if spans is None:
        return None
    return negative_credit(ids, token_char_ends(ids, tokenizer), spans)


def blamed_fraction(trajs: Sequence[Any], advantages: Sequence[float], weights: Sequence[Sequence[float] | None]) -> float:
    """The share of the negative-advantage rollouts' action tokens that ``call`` credit still blames
    (1.0 = the same as sequence credit; logged per step as ``credit_blamed_frac``)."""
    total = blamed = 0.0
    for t, v, w in zip(trajs, advantages, weights):
        if v >= 0:
            continue
        mask = list(t.loss_mask)
        total += sum(mask)
        blamed += sum(mask) if w is None else sum(m * x for m, x in zip(mask, w))
    return blamed / total if total else 1.0
