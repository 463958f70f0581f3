"""One API for local paths and `s3://bucket/key` URIs.

S3 settings come from the environment: AWS_ENDPOINT_URL (or DSPARK_S3_ENDPOINT), AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION (default us-east-1). With the local stack, `source .dspark/env.sh`
(or `os.environ.update(dspark.devstack.config.load_env())`) sets all of them.

A "directory" URI is a prefix: `list_files("s3://b/run1")` lists every object under `run1/`
(recursively), just as it lists every file under a local directory. Missing objects raise
FileNotFoundError; an unreachable endpoint or bucket raises StorageError with the fix.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from tqdm.auto import tqdm

from dspark.settings import settings

S3_SCHEME = "s3://"


class StorageError(RuntimeError):
    """The storage backend cannot be used (unreachable endpoint, missing bucket, bad credentials)."""


# ---------------------------------------------------------------------------- URIs
def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith(S3_SCHEME)


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b")."""
    if not is_s3(uri):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} has no bucket; write it as s3://BUCKET/KEY")
    return bucket, key


def join(uri: str | os.PathLike, *parts: str) -> str:
    """Append path parts to a local path or s3 URI (no duplicate slashes)."""
    uri = str(uri)
    if not is_s3(uri):
        return os.path.join(uri, *parts)
    pieces = [uri.rstrip("/")] + [p.strip("/") for p in parts if p.strip("/")]
    return "/".join(pieces)


def _dir_prefix(key: str) -> str:
    """Key prefix that selects everything below `key` taken as a directory."""
    return key.rstrip("/") + "/" if key.strip("/") else ""


# ---------------------------------------------------------------------------- S3 client
def s3_settings() -> dict:
    """Endpoint and credentials from the environment (endpoint None = AWS itself)."""
    env = settings()
    return {"endpoint": env.s3_endpoint_url, "key": env.aws_access_key_id, "secret": env.aws_secret_access_key,
            "region": env.aws_region}


def s3_client():
    """A boto3 S3 client for the current environment (cached per settings; thread-safe)."""
    settings = s3_settings()
    return _cached_client(settings["endpoint"], settings["key"], settings["secret"], settings["region"])


@functools.lru_cache(maxsize=8)
def _cached_client(endpoint, key, secret, region):
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=10, read_timeout=120, retries={"max_attempts": 4, "mode": "standard"},
                    s3={"addressing_style": "path"} if endpoint else {})
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                        region_name=region, config=config)


def _endpoint_hint() -> str:
    return ("start the local stack with `dspark stack up` and `source .dspark/env.sh`, "
            "or set AWS_ENDPOINT_URL/AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")


@contextmanager
def _s3_errors(uri: str):
    """Translate boto errors: missing object -> FileNotFoundError, the rest -> StorageError."""
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    try:
        yield
    except ClientError as err:
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            raise FileNotFoundError(f"no such object: {uri}") from None
        if code == "NoSuchBucket":
            raise StorageError(f"bucket of {uri} does not exist at {s3_settings()['endpoint'] or 'AWS'}; "
                               f"create it or use s3://dspark/... with the local stack") from None
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            raise StorageError(f"S3 refused access to {uri} ({code}); check AWS_ACCESS_KEY_ID/"
                               f"AWS_SECRET_ACCESS_KEY ({_endpoint_hint()})") from None
        raise StorageError(f"S3 error on {uri}: {code}: {err}") from None
    except NoCredentialsError:
        raise StorageError(f"no S3 credentials for {uri}; {_endpoint_hint()}") from None
    except EndpointConnectionError:
        raise StorageError(f"S3 endpoint {s3_settings()['endpoint'] or 'AWS'} is unreachable for {uri}; "
                           f"{_endpoint_hint()}") from None
    except BotoCoreError as err:
        raise StorageError(f"S3 request for {uri} failed ({type(err).__name__}: {err}); {_endpoint_hint()}") from None


# ---------------------------------------------------------------------------- bytes / text
def read_bytes(uri: str | os.PathLike) -> bytes:
    uri = str(uri)
    if not is_s3(uri):
        return Path(uri).read_bytes()
    bucket, key = split_s3(uri)
    with _s3_errors(uri):
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()


def write_bytes(uri: str | os.PathLike, data: bytes) -> None:
    """Write a whole object/file (local writes are atomic: temp file + rename)."""
    uri = str(uri)
    if not is_s3(uri):
        _atomic_write(Path(uri), data)
        return
    bucket, key = split_s3(uri)
    with _s3_errors(uri):
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)


def read_text(uri: str | os.PathLike) -> str:
    return read_bytes(uri).decode("utf-8")


def write_text(uri: str | os.PathLike, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- listing
def exists(uri: str | os.PathLike) -> bool:
    """True for an existing file/object, or a directory/prefix with something in it."""
    uri = str(uri)
    if not is_s3(uri):
        return os.path.exists(uri)
    bucket, key = split_s3(uri)
    with _s3_errors(uri):
        if key and not key.endswith("/") and _head(bucket, key, uri) is not None:
            return True
        listing = s3_client().list_objects_v2(Bucket=bucket, Prefix=_dir_prefix(key), MaxKeys=1)
        return listing.get("KeyCount", 0) > 0 or not key.strip("/")


def _head(bucket: str, key: str, uri: str) -> dict | None:
    try:
        with _s3_errors(uri):
            return s3_client().head_object(Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None


def _list_objects(bucket: str, prefix: str) -> list[dict]:
    paginator = s3_client().get_paginator("list_objects_v2")
    objects = []
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        objects.extend(page.get("Contents", []))
    return objects


def list_files(uri_prefix: str | os.PathLike) -> list[str]:
    """Every file under a directory/prefix, recursively, as full URIs (sorted). A file URI lists
    itself; a missing one gives []."""
    uri = str(uri_prefix)
    if not is_s3(uri):
        root = Path(uri)
        if root.is_file():
            return [str(root)]
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    bucket, key = split_s3(uri)
    with _s3_errors(uri):
        found = [f"{S3_SCHEME}{bucket}/{o['Key']}" for o in _list_objects(bucket, _dir_prefix(key))
                 if not o["Key"].endswith("/")]
        if key and not key.endswith("/") and _head(bucket, key, uri) is not None:
            found.append(uri)
    return sorted(found)


def delete(uri: str | os.PathLike, missing_ok: bool = False) -> None:
    """Delete a file/object, or a whole directory/prefix."""
    uri = str(uri)
    if not is_s3(uri):
        path = Path(uri)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        elif not missing_ok:
            raise FileNotFoundError(f"no such file or directory: {uri}")
        return
    bucket, key = split_s3(uri)
    targets = list_files(uri)
    if not targets and not missing_ok:
        raise FileNotFoundError(f"no such object or prefix: {uri}")
    keys = [split_s3(t)[1] for t in targets]
    with _s3_errors(uri):
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            s3_client().delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


# ---------------------------------------------------------------------------- directories
def upload_dir(local_dir: str | os.PathLike, uri: str | os.PathLike) -> list[str]:
    """Copy every file under `local_dir` to `uri` (keeping relative paths); returns written URIs."""
    root, uri = Path(local_dir), str(uri)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {root}")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    written = []
    for path in tqdm(files, desc=f"upload {uri}", unit="file", disable=len(files) < 10 or None):
        target = join(uri, path.relative_to(root).as_posix())
        put_file(path, target)
        written.append(target)
    return written


def put_file(local_path: str | os.PathLike, uri: str | os.PathLike) -> None:
    """Copy one local file to a path or URI (multipart upload for large files)."""
    uri = str(uri)
    if not is_s3(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local_path, uri)
        return
    bucket, key = split_s3(uri)
    with _s3_errors(uri):
        s3_client().upload_file(str(local_path), bucket, key)


def get_file(uri: str | os.PathLike, local_path: str | os.PathLike) -> None:
    """Copy one file/object to a local path (atomically: temp file + rename)."""
    uri, local_path = str(uri), Path(local_path)
    local_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local_path.parent, prefix=f".{local_path.name}.")
    os.close(fd)
    try:
        if is_s3(uri):
            bucket, key = split_s3(uri)
            with _s3_errors(uri):
                s3_client().download_file(bucket, key, tmp)
        else:
            shutil.copyfile(uri, tmp)
        os.replace(tmp, local_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def download_dir(uri: str | os.PathLike, local_dir: str | os.PathLike) -> list[str]:
    """Copy every file under `uri` into `local_dir` (keeping relative paths); returns local paths."""
    uri = str(uri)
    files = list_files(uri)
    if not files:
        raise FileNotFoundError(f"nothing to download under {uri}")
    root = Path(local_dir)
    written = []
    for source in tqdm(files, desc=f"download {uri}", unit="file", disable=len(files) < 10 or None):
        target = root / _relative(source, uri)
        get_file(source, target)
        written.append(str(target))
    return written


def _relative(file_uri: str, dir_uri: str) -> str:
    rel = file_uri[len(dir_uri.rstrip("/")):].lstrip("/")
    return rel or os.path.basename(file_uri)


# ---------------------------------------------------------------------------- local cache
def cache_dir() -> Path:
    root = settings().cache
    return root / "s3"


def local_copy(uri: str | os.PathLike) -> str:
    """A local path holding `uri`: the path itself when local; for S3 a cached download under
    $DSPARK_CACHE/s3/<endpoint>/<bucket>/<key> (a file or a directory), refreshed only for objects
    whose ETag changed. Safe to call from many processes at once (file lock per URI)."""
    uri = str(uri)
    if not is_s3(uri):
        if not os.path.exists(uri):
            raise FileNotFoundError(f"no such file or directory: {uri}")
        return uri
    bucket, key = split_s3(uri)
    endpoint = urlparse(s3_settings()["endpoint"] or "https://aws").netloc.replace(":", "_")
    target = cache_dir() / endpoint / bucket / key.strip("/")
    objects = _objects_under(uri)
    if not objects:
        raise FileNotFoundError(f"no such object or prefix: {uri}")
    with _file_lock(target.with_name(target.name + ".lock")):
        manifest_path = target.with_name(target.name + ".manifest.json")
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        is_single_file = list(objects) == [uri]
        for source, etag in objects.items():
            local = target if is_single_file else target / _relative(source, uri)
            if manifest.get(source) != etag or not local.exists():
                get_file(source, local)
                manifest[source] = etag
        _atomic_write(manifest_path, json.dumps(manifest).encode())
    return str(target)


def _objects_under(uri: str) -> dict[str, str]:
    """URI -> ETag for the object at `uri` or every object under it as a prefix."""
    bucket, key = split_s3(uri)
    with _s3_errors(uri):
        if key and not key.endswith("/"):
            head = _head(bucket, key, uri)
            if head is not None:
                return {uri: head["ETag"]}
        return {f"{S3_SCHEME}{bucket}/{o['Key']}": o["ETag"]
                for o in _list_objects(bucket, _dir_prefix(key)) if not o["Key"].endswith("/")}


@contextmanager
def _file_lock(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------- pyarrow / checks
def pyarrow_fs(uri: str | os.PathLike):
    """(pyarrow FileSystem, path inside it) for Ray Data `filesystem=` / `paths=` arguments.
    The S3 endpoint is passed explicitly (pyarrow does not honour AWS_ENDPOINT_URL everywhere)."""
    import pyarrow.fs as pafs

    uri = str(uri)
    if not is_s3(uri):
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    settings = s3_settings()
    options = {"region": settings["region"], "access_key": settings["key"], "secret_key": settings["secret"]}
    if settings["endpoint"]:
        parsed = urlparse(settings["endpoint"])
        options |= {"endpoint_override": parsed.netloc or parsed.path, "scheme": parsed.scheme or "https",
                    "force_virtual_addressing": False}
    bucket, key = split_s3(uri)
    return pafs.S3FileSystem(**options), f"{bucket}/{key}".rstrip("/")


def check_writable(uri: str | os.PathLike) -> None:
    """Fail fast (StorageError, one line with the fix) if `uri` cannot be written: writes and
    deletes a small probe object/file below it."""
    uri = str(uri)
    probe = join(uri, f".dspark-write-check-{uuid.uuid4().hex[:12]}")
    if not is_s3(uri):
        try:
            write_bytes(probe, b"ok")
            os.unlink(probe)
        except OSError as err:
            raise StorageError(f"cannot write to {uri} ({err.strerror or err}); choose a writable directory") from None
        return
    try:
        write_bytes(probe, b"ok")
        delete(probe)
    except (StorageError, FileNotFoundError) as err:
        raise StorageError(str(err).replace(probe, uri)) from None


def content_hash(uri: str | os.PathLike) -> str:
    """sha256 of a file's/object's bytes (for manifests and tests)."""
    return hashlib.sha256(read_bytes(uri)).hexdigest()


def dataset_digest(uri: str) -> str:
    """Content digest of a file, or of every file under a directory/prefix: sha256 over each file's
    path relative to `uri` and the sha256 of its bytes (so renames and edits both change it).
    Reads the data: give large datasets' digest explicitly (e.g. from their manifest)."""
    files = list_files(uri)
    if not files:
        raise FileNotFoundError(f"no file at {uri}")
    total = hashlib.sha256()
    base = uri.rstrip("/")
    for file in files:
        relative = file[len(base):].lstrip("/") if file.startswith(base) else file
        total.update(f"{relative}\0{content_hash(file)}\n".encode())
    return total.hexdigest()[:32]
