"""System prompts, chat messages and tool observations."""
from __future__ import annotations

import json

import pytest

from reflrl.envs.parsing import FORMATS, parse
from reflrl.envs.prompts import (STYLES, build_messages, compact_signature, render_tool_error,
                                 render_tool_result, system_prompt, tool_schema)
from reflrl.envs.types import Task, ToolCall

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city. Backed by faker data.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
         "required": ["city"]}},
    {"type": "function", "function": {
        "name": "send_message", "description": "Send a chat message to a contact",
        "parameters": {"type": "object", "properties": {
            "priority": {"type": "integer"},
            "to": {"type": "string"}, "body": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["to", "body"]}}},
    {"name": "math.hypot", "description": "", "parameters": {"type": "dict", "properties": {
        "x": {"type": "float"}, "y": {"type": ["number", "null"]}}, "required": ["x", "y"]}},
    {"name": "list_files", "description": "List the sandbox files"},
]
REQUIRED = {"get_weather": ["city"], "send_message": ["to", "body"], "math.hypot": ["x", "y"],
            "list_files": []}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tool_and_required_argument_is_shown(style, fmt):
    prompt = system_prompt(TOOLS, style=style, fmt=fmt)
    for name, req in REQUIRED.items():
        assert name in prompt
        for arg in req:
            assert arg in prompt
    # the example in the instruction is valid in the announced format
    example = prompt.split("\n")
    assert any(parse("\n".join(example[i:i + k]), fmt).calls
               for k in (1, 2, 3) for i in range(len(example)))


def test_compact_signature_line():
    line = compact_signature(TOOLS[0])
    assert line == ('get_weather(city: str, unit: "celsius"|"fahrenheit" = "celsius") '
                    "- Current weather for a city")
    # required first, optional without default marked with ?
    assert compact_signature(TOOLS[1]) == ("send_message(to: str, body: str, priority?: int, "
                                           "tags?: list[str]) - Send a chat message to a contact")
    assert compact_signature(TOOLS[2]) == "math.hypot(x: float, y: float|None)"
    assert compact_signature(TOOLS[3]) == "list_files() - List the sandbox files"


def test_compact_is_shorter_than_json_and_json_holds_the_schemas():
    compact = system_prompt(TOOLS, style="compact")
    full = system_prompt(TOOLS, style="json")
    assert len(compact) < len(full)
    inside = full.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in inside] == [
        "get_weather", "send_message", "math.hypot", "list_files"]
    assert json.loads(inside[0])["function"]["parameters"] == TOOLS[0]["parameters"]
    assert "<tool_call>" in full


def test_think_option_and_bad_arguments():
    assert "<think>" in system_prompt(TOOLS, think=True)
    assert "<think>" not in system_prompt(TOOLS)
    with pytest.raises(ValueError, match="unknown prompt style 'xml'"):
        system_prompt(TOOLS, style="xml")
    with pytest.raises(ValueError, match="unknown tool-call format"):
        system_prompt(TOOLS, fmt="yaml")
    with pytest.raises(ValueError, match="no name"):
        tool_schema({"description": "nameless"})


def test_build_messages():
    task = Task(id="t1", query="Weather in Paris?", tools=TOOLS[:1],
                gold=[[ToolCall("get_weather", {"city": "Paris"})]])
    msgs = build_messages(task, style="compact", fmt="pythonic")
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"] == "Weather in Paris?"
    assert msgs[0]["content"] == system_prompt(task.tools, style="compact", fmt="pythonic")


def test_render_tool_observations():
    assert json.loads(render_tool_result("get_weather", {"temp": 21})) == {
        "name": "get_weather", "result": {"temp": 21}}
    long = render_tool_result("cat", "x" * 5000, max_chars=100)
    assert len(long) < 140 and long.endswith("chars]")
    assert len(render_tool_result("cat", "x" * 5000, max_chars=0)) > 5000
    assert json.loads(render_tool_error("f", "missing argument 'city'", "invalid_arguments")) == {
        "name": "f", "error": "missing argument 'city'", "kind": "invalid_arguments"}
