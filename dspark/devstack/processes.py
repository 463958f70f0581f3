"""Processes and ports of the local stack, through psutil: start times (a PID is trusted only with
its start time, so a recycled PID is never signalled), session members and their descendants,
graceful termination, who listens on a port, and the JSON summary a child printed last."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

HOST = "127.0.0.1"


# ---------------------------------------------------------------------------- processes
def proc_start_time(pid: int) -> float | None:
    """Start time (seconds since the epoch) of a live, non-zombie process, else None."""
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return proc.create_time()
    except psutil.Error:
        return None


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def session_processes(sid: int) -> set[int]:
    """Live processes in session `sid` plus all their descendants (which may have left it)."""
    found: set[int] = set()
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.pid)
                found.update(child.pid for child in proc.children(recursive=True))
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    found.discard(os.getpid())
    return found


def terminate(pids: set[int], grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whatever is left; returns when all are gone."""
    identities = {pid: proc_start_time(pid) for pid in pids}
    alive = {pid for pid, started in identities.items() if started is not None}

    def still_alive() -> set[int]:
        return {pid for pid in alive if proc_start_time(pid) == identities[pid]}

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in still_alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while still_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not still_alive():
            return


@dataclass
class ServiceRecord:
    """What `up` remembers about a service it started (`pids/<service>.json`)."""

    service: str
    pid: int
    start_time: int
    sid: int
    sid_start_time: int  # start time of the session leader (to detect a recycled session id)
    ports: dict[str, int]
    url: str
    log: str

    def alive(self) -> bool:
        return proc_start_time(self.pid) == self.start_time

    def leftover_processes(self) -> set[int]:
        """Processes of the recorded session still running (safe: a session id stays reserved
        while any member lives, and the leader is checked against its start time)."""
        leader_started = proc_start_time(self.sid)
        if leader_started is not None and leader_started != self.sid_start_time:
            return set()  # session id recycled by an unrelated process
        return session_processes(self.sid)


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen:
    """Start `cmd` in a new session with output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


def _last_log_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


# ---------------------------------------------------------------------------- ports
def port_is_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:port (or on the wildcard address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def port_owner(port: int) -> str:
    """'pid 123 (name)' of the listener on `port` when the OS tells us, else 'another process'."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return "another process"
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return f"pid {conn.pid} ({process_name(conn.pid) or '?'})"
    return "another process"


def _wait_ports_free(ports, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(port_is_free(p) for p in ports):
        time.sleep(0.2)


def last_json_object(lines: list[str]) -> tuple[dict | None, bool]:
    """(the last line that parses as a JSON object, whether it was the very last non-empty line).
    Ray may flush its workers' log lines after a script's final print, so trailing lines that are
    not JSON are skipped (and flagged in the report) rather than failing the benchmark."""
    non_empty = [line for line in lines if line.strip()]
    for position, line in enumerate(reversed(non_empty)):
        text = line.strip()
        if not (text.startswith("{") and text.endswith("}")):
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value, position == 0
    return None, False
