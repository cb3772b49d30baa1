"""Our tasks as verl dataset rows (parquet), for ``data.train_files`` / ``data.val_files``.

One row per task, in the layout verl's ``RLHFDataset`` reads (verl 0.9.1):
``data_source``, ``prompt`` (chat messages: our system prompt with the tools + the query),
``ability``, ``reward_model`` ({"style": "rule", "ground_truth": gold calls as JSON}),
``agent_name`` (which agent loop runs the row: ``reflrl_tool_agent``) and ``extra_info``
({"index", "task": JSON of task_to_dict(task), "reward", "parser", + episode settings such as
"faults"}). The task is a JSON string so parquet does not merge the tool schemas of different rows
into one struct type (which would add null keys).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from reflrl.envs.types import Task

DATA_SOURCE = "reflrl"


def rows_from_tasks(tasks: Iterable[Task], *, reward: str = "binary", parser: str = "hermes",
                    prompt_style: str = "json", agent_name: str = "reflrl_tool_agent",
                    episode: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """verl rows for ``tasks`` (module doc). ``episode``: per-row episode settings
    (:class:`reflrl.verl_backend.agent_loop.EpisodeSettings` fields, e.g. {"faults": "rate_limit=0.1"})."""
    from reflrl.envs.datasets import task_to_dict
    from reflrl.envs.prompts import build_messages

    rows = []
    for i, t in enumerate(tasks):
        if not isinstance(t, Task):
            raise TypeError(f"task {i} is a {type(t).__name__}, not a Task")
        extra = {"index": i, "task": json.dumps(task_to_dict(t)), "reward": reward, "parser": parser,
                 "prompt_style": prompt_style, **dict(episode or {})}
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": build_messages(t, prompt_style, parser),
            "ability": "tool_calling",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(task_to_dict(t)["gold"])},
            "agent_name": agent_name,
            "extra_info": extra,
        })
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to a parquet file with pandas/pyarrow (verl's own dependencies); returns the path."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path
