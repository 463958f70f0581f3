"""A replica killed mid-stream (slow tier, a real Ray Serve deployment of `tiny`): `kill -9` of the replica's
process while 8 streams run ends every client's stream (an error event or a closed connection) within a
bounded time, never a hang; Serve starts a new replica and a new request succeeds within a stated time."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.serve_deployment import HEADERS, replica_pids, serve_tiny
from tests.unit.serve.test_serve import CHAT, drafter_dir, tiny  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STREAMS = 8
STREAM_END_S = 30  # after the kill, every stream has ended within this
RECOVERY_S = 120  # after the kill, a new request succeeds within this
APP = "dspark-kill"


@pytest.fixture
def deployment(drafter_dir):
    with serve_tiny(drafter_dir, APP) as url:
        yield url, HEADERS


def stream(url: str, headers: dict, outcome: dict, first_token: threading.Event) -> None:
    """One streaming chat request; records how it ended (done, error event, closed) and when."""
    body = {**CHAT, "stream": True, "max_tokens": 200, "temperature": 1.0}  # within max_model_len 256
    outcome["events"] = 0
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as resp:
            outcome["status"] = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome["end"] = "done"
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    outcome["end"] = "error_event"
                    break
                outcome["events"] += 1
                first_token.set()
            else:
                outcome["end"] = "closed"
    except httpx.HTTPError as err:
        outcome["end"] = f"closed ({type(err).__name__})"
    outcome["at"] = time.monotonic()


def test_replica_kill_ends_every_stream_and_serve_recovers(deployment):
    url, headers = deployment
    (pid,) = replica_pids(APP)
    outcomes = [{} for _ in range(STREAMS)]
    started = [threading.Event() for _ in range(STREAMS)]
    clients = [threading.Thread(target=stream, args=(url, headers, o, e), daemon=True)
               for o, e in zip(outcomes, started)]
    for client in clients:
        client.start()
    assert all(e.wait(60) for e in started), f"every stream got its first tokens: {outcomes}"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for client in clients:
        client.join(timeout=STREAM_END_S + 5)
    assert not any(c.is_alive() for c in clients), f"a stream hung after the kill: {outcomes}"
    assert all(o["at"] - killed_at <= STREAM_END_S for o in outcomes), outcomes
    assert all(o["end"] != "done" or o["events"] for o in outcomes), outcomes
    assert any(o["end"] != "done" for o in outcomes), f"the kill cut at least one stream short: {outcomes}"

    recovered_at = None
    while time.monotonic() - killed_at < RECOVERY_S:
        try:
            resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 8}, headers=headers, timeout=30)
            if resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] is not None:
                recovered_at = time.monotonic()
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    assert recovered_at is not None, f"no successful request within {RECOVERY_S} s of the kill"
    new_pids = replica_pids(APP)
    assert new_pids and pid not in new_pids, "Serve replaced the killed replica"
    print(json.dumps({"stream_ends": sorted(o["end"] for o in outcomes),
                      "slowest_stream_end_s": round(max(o["at"] for o in outcomes) - killed_at, 2),
                      "recovery_s": round(recovered_at - killed_at, 1)}))
