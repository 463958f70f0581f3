"""Tool calls (OpenAI `tools` + `tool_choice`) as structured output.

With `tool_choice: "required"` or a named function, the answer is one call, decoded under the grammar of
{"name": <a tool's name>, "arguments": <that tool's parameters schema>} (dspark/decoding/constraint.py: exact
for the target's distribution restricted to it, with speculative decoding), and returned as `tool_calls`
(finish_reason "tool_calls"). The tools are shown to the model in a system message. `"auto"` (the model
choosing between text and a call) needs a tool-call format the target was trained on: not served yet (400).
"""
from __future__ import annotations

import json
import uuid
from typing import Any


def active_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict]:
    """The tools the answer must call (one of): all for "required", the named one, none for "none" or no tools.
    ValueError (a 400 naming tool_choice) for "auto" — also OpenAI's default when tools are sent — and for a
    choice that names no tool."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice == "none" or (not names and tool_choice is None):
        return []
    if not names:
        raise ValueError("tool_choice needs tools")
    if tool_choice in (None, "auto"):
        raise ValueError("tool_choice 'auto' (the default with tools) is not supported by this server yet: the model "
                         "cannot choose between text and a call; send tool_choice 'required', a named function or 'none'")
    if tool_choice == "required":
        return tools
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in names:
        raise ValueError(f"tool_choice must be 'none', 'required' or {{'type': 'function', 'function': {{'name': one "
                         f"of {names}}}}}, got {tool_choice!r}")
    return [t for t in tools if t["function"]["name"] == name]


def call_schema(tools: list[dict]) -> dict:
    """JSON schema of one call to any of `tools`."""
    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_message(tools: list[dict]) -> dict:
    """A system message telling the model which functions it may call and how the call is written."""
    lines = ['Call one of these functions, as {"name":...,"arguments":{...}}:']
    for t in tools:
        f = t["function"]
        spec = {"name": f["name"], **({"description": f["description"]} if f.get("description") else {}),
                "parameters": f.get("parameters") or {"type": "object"}}
        lines.append(json.dumps(spec, separators=(",", ":")))
    return {"role": "system", "content": "\n".join(lines)}


def tool_calls_of(text: str) -> list[dict] | None:
    """The OpenAI `tool_calls` of a finished constrained answer, None when it is not a whole call (cut by
    max_tokens): then the text is returned as content, as OpenAI does with finish_reason "length"."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]
