"""JSONL lines exactly as the format defines them: records end at "\\n" (an optional "\\r" before it
is dropped), and at nothing else.

`str.splitlines()` also breaks at U+2028, U+2029, \\x85 and \\x1c-\\x1e, which JSON allows unescaped
inside strings, so it would cut a valid record in two; every JSONL reader goes through `jsonl_lines`.
"""
from __future__ import annotations

from typing import Iterator


def jsonl_lines(text: str | bytes) -> Iterator[tuple[int, str | bytes]]:
    """(1-based line number, line) for every non-blank line of JSONL `text`. Bytes in, bytes out:
    a reader that decodes line by line can report a bad encoding with its line number."""
    newline, cr = ("\n", "\r") if isinstance(text, str) else (b"\n", b"\r")
    for number, line in enumerate(text.split(newline), start=1):
        line = line.removesuffix(cr)
        if line.strip():
            yield number, line
