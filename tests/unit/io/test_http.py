"""wait_healthy against a real local HTTP server: polls until ready, times out naming the last answer."""
from __future__ import annotations

import socket
import time

import pytest

from dspark.io.http import http_ok, wait_healthy
from tests.http_stub import http_stub


@pytest.fixture
def warming_server():
    """Answers 503 to the first two GETs, then 200 with the number of GETs so far."""
    hits = []

    def answer(request):
        hits.append(request.path)
        return (503 if len(hits) <= 2 else 200), str(len(hits)).encode()

    with http_stub(answer) as url:
        yield url, hits


def test_wait_healthy_polls_until_200_and_ready(warming_server):
    url, hits = warming_server
    assert not http_ok(url + "/healthz")  # the first 503
    resp = wait_healthy(url + "/healthz", timeout_s=10, interval_s=0.01, ready=lambda r: int(r.text) >= 4)
    assert resp.status_code == 200 and resp.text == "4" and len(hits) == 4  # 503, 503 (http_ok + 1), 200 not ready, ready


def test_wait_healthy_times_out_with_the_last_answer_and_hint(warming_server):
    url, hits = warming_server
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not healthy within 1 s \(HTTP (503|200): \d+\); look at the log"):
        wait_healthy(url + "/healthz", timeout_s=1.0, interval_s=0.05, hint="look at the log", ready=lambda r: False)
    assert 1.0 <= time.monotonic() - started < 4.0 and len(hits) >= 2  # asked again until the deadline


def test_wait_healthy_names_the_connection_error_when_nothing_listens():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/healthz"  # closed again: connection refused
    with pytest.raises(TimeoutError, match="ConnectError"):
        wait_healthy(url, timeout_s=0.2, interval_s=0.05)
