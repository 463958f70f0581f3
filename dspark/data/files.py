"""The file operations the data code takes from its caller, so that it never imports dspark.io.

`Files` names what reading prompt sources needs. dspark.io.storage (the module) provides every one
of them for local paths and s3:// URIs, and the edges (jobs, pipelines, recipes) pass it. `LOCAL`
does them for local paths only — the default when a caller passes nothing — and refuses an
object-store URI with the fix, instead of writing a local directory named "s3:".
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class Files(Protocol):
    def is_s3(self, uri: str) -> bool: ...

    def join(self, uri: str, *parts: str) -> str: ...

    def list_files(self, uri: str) -> list[str]:
        """Every file under a directory/prefix, recursively, sorted; a file lists itself; missing: []."""

    def read_bytes(self, uri: str) -> bytes: ...

    def read_text(self, uri: str) -> str: ...

    def write_text(self, uri: str, text: str) -> None: ...

    def pyarrow_fs(self, uri: str) -> tuple:
        """(pyarrow FileSystem, path inside it)."""

    def local_copy(self, uri: str) -> str:
        """A local path holding `uri` (the path itself when local)."""


def _local(uri) -> str:
    uri = str(uri)
    if "://" in uri:
        raise ValueError(f"{uri} is an object-store URI: pass files=dspark.io.storage to read or write it "
                         f"(the jobs and pipelines do)")
    return uri


class LocalFiles:
    """`Files` on the local filesystem (the same semantics as dspark.io.storage's local branch)."""

    def is_s3(self, uri) -> bool:
        return str(uri).startswith("s3://")

    def join(self, uri, *parts: str) -> str:
        return os.path.join(_local(uri), *parts)

    def list_files(self, uri) -> list[str]:
        root = Path(_local(uri))
        if root.is_file():
            return [str(root)]
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []

    def read_bytes(self, uri) -> bytes:
        return Path(_local(uri)).read_bytes()

    def read_text(self, uri) -> str:
        return self.read_bytes(uri).decode("utf-8")

    def write_text(self, uri, text: str) -> None:
        path = Path(_local(uri))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    def pyarrow_fs(self, uri) -> tuple:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem(), os.path.abspath(_local(uri))

    def local_copy(self, uri) -> str:
        if not os.path.exists(_local(uri)):
            raise FileNotFoundError(f"no such file or directory: {uri}")
        return str(uri)


LOCAL = LocalFiles()
