"""Tool calls (OpenAI `tools` + `tool_choice`) as structured output.

With `tool_choice: "required"` or a named function, the answer is one call, decoded under the grammar of
{"name": <a tool's name>, "arguments": <that tool's parameters schema>} (dspark/decoding/constraint.py: exact
for the target's distribution restricted to it, with speculative decoding), and returned as `tool_calls`
(finish_reason "tool_calls"). With `"auto"` (OpenAI's default when tools are sent) the model answers freely
and an answer that is exactly such a call to one of the tools is returned as `tool_calls`, any other as text
(the target's own distribution, unconstrained: how well it calls depends on the format it was trained on).
The tools are shown to the model in a system message.
"""
from __future__ import annotations

import json
import uuid
from typing import Any


def tool_plan(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict], bool]:
    """(the tools offered to the model, whether the answer is constrained to a call of one of them):
    "none" or no tools -> ([], False); "auto" / unset with tools -> (all, False); "required" -> (all, True);
    a named function -> ([it], True). ValueError (a 400 naming tool_choice) for a choice that names no tool."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice == "none" or (not names and tool_choice is None):
        return [], False
    if not names:
        raise ValueError("tool_choice needs tools")
    if tool_choice in (None, "auto"):
        return list(tools), False
    if tool_choice == "required":
        return list(tools), True
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in names:
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': one of {names}}}}}, got {tool_choice!r}")
    return [t for t in tools if t["function"]["name"] == name], True


def active_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict]:
    """The tools the answer is constrained to call (one of); [] when it is not constrained."""
    offered, constrained = tool_plan(tools, tool_choice)
    return offered if constrained else []


def call_schema(tools: list[dict]) -> dict:
    """JSON schema of one call to any of `tools`."""
    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_message(tools: list[dict], required: bool = True) -> dict:
    """A system message telling the model which functions it may call and how the call is written."""
    lines = ['Call one of these functions, as {"name":...,"arguments":{...}}:' if required else
             'You may call one of these functions: to call one, answer with only {"name":...,"arguments":{...}}; '
             'otherwise answer normally.']
    for t in tools:
        f = t["function"]
        spec = {"name": f["name"], **({"description": f["description"]} if f.get("description") else {}),
                "parameters": f.get("parameters") or {"type": "object"}}
        lines.append(json.dumps(spec, separators=(",", ":")))
    return {"role": "system", "content": "\n".join(lines)}


def tool_calls_of(text: str, names: list[str] | None = None) -> list[dict] | None:
    """The OpenAI `tool_calls` of a finished answer that is exactly one call {"name", "arguments": {...}} (to one
    of `names`, when given); None otherwise (a call cut by max_tokens, or a text answer): then the text is
    returned as content, as OpenAI does."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and isinstance(call["arguments"], dict)
            and isinstance(call["name"], str) and (names is None or call["name"] in names)):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]
