"""What a benchmark script ends with: its result JSON written to `--out` (folders made) when given, and printed
as the last stdout line (what `run_all` and the GPU recipe read)."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> dict:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result
