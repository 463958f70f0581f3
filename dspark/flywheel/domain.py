"""Which domain a request belongs to, for per-domain acceptance metrics and capture.

Order: the request's `metadata.domain` (OpenAI chat/completions accept a `metadata` map), else its
`user` field when it names a known domain (`user: "math"` or `user: "team-a:code"`: the part after the
last ':'), else what the request asks for: "tools" when it offers tools, "json" with a JSON response_format
(the traffic where acceptance collapses most), else a keyword classifier over the prompt text (math / code /
chat). The classifier is a cheap fallback, not a model: a few regexes counted over the last user turn, ties
-> "chat".
"""
from __future__ import annotations

import re

DOMAINS = ("math", "code", "chat", "tools", "json")
MAX_DOMAIN_CHARS = 32  # a label, not free text: longer values (and odd characters) fall back to "other"
_LABEL = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")

_MATH = re.compile(r"\d+\s*[-+*/^=]\s*\d+|\b(sum|solve|equation|integral|derivative|how many|how much|"
                   r"percent|probability|calculate|compute|total|prime|divisible|remainder)\b", re.I)
_CODE = re.compile(r"```|\bdef |\bclass |\breturn\b|\bimport |\bfunction\b|\bpython\b|\bjavascript\b|"
                   r"\bcompile|\bbug\b|\bregex\b|\bsql\b|[{};]\s*$|=>|\(\)", re.I | re.M)


def normalise(label: str | None) -> str | None:
    """A metric-safe domain label (lowercase, short, [a-z0-9_.-]) or None."""
    if not label:
        return None
    label = label.strip().lower()
    if len(label) > MAX_DOMAIN_CHARS or not _LABEL.match(label):
        return "other"
    return label


def classify(text: str) -> str:
    """Keyword classifier: the domain whose patterns match most often; "chat" without a match."""
    scores = {"math": len(_MATH.findall(text)), "code": len(_CODE.findall(text))}
    best = max(scores, key=scores.get)
    return best if scores[best] > 0 and scores["math"] != scores["code"] else "chat"


def resolve(metadata: dict | None, user: str | None, prompt_text: str, shape: str | None = None) -> tuple[str, str]:
    """(domain, how it was found: "metadata" | "user" | "request" | "classifier"); `shape`: "tools" or "json"
    when the request offers tools or asks for JSON output."""
    tagged = normalise((metadata or {}).get("domain"))
    if tagged:
        return tagged, "metadata"
    if user:
        named = normalise(user.rsplit(":", 1)[-1])
        if named in DOMAINS:
            return named, "user"
    if shape:
        return shape, "request"
    return classify(prompt_text), "classifier"


def request_shape(body) -> str | None:
    """"tools" for a chat request offering tools (tool_choice not "none"), "json" for a JSON response_format."""
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        return "tools"
    if (getattr(body, "response_format", None) or {}).get("type") in ("json_object", "json_schema"):
        return "json"
    return None
