"""Overload, measured (slow tier, a real Ray Serve deployment of `tiny` on one replica): a burst of 256
concurrent clients. Every request either completes or is shed at once with 429/503, `Retry-After` and OpenAI's
error shape (never a hang or a 500); the accepted requests' p50/p99 latency and the replica's peak RSS are
reported and bounded; a request right after the burst succeeds."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

from tests.integration.serve_deployment import HEADERS, replica_pids, serve_tiny
from tests.unit.serve.test_serve import _check_error_shape, drafter_dir, tiny  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
APP = "dspark-overload"
CLIENTS = 256
MAX_RSS_BYTES = 3 * 2**30  # the replica's peak resident memory through the burst stays below this
MAX_WAITING = 64  # the replica's queue beyond its running batch (engine.max_waiting): the rest is shed


def sample_peak_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    import psutil

    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            peak[0] = max(peak[0], proc.memory_info().rss)
        except psutil.Error:
            return
        time.sleep(0.05)


async def burst(url: str) -> list[tuple[httpx.Response | Exception, float]]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=300, limits=limits) as client:
        async def one(i: int):
            body = {"messages": [{"role": "user", "content": f"question {i}: what is the sum"}], "max_tokens": 24,
                    "temperature": 1.0}
            t0 = time.monotonic()
            try:
                resp = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as err:
                return err, time.monotonic() - t0
            return resp, time.monotonic() - t0
        return await asyncio.gather(*(one(i) for i in range(CLIENTS)))


def test_overload_burst_completes_or_sheds_with_retry_after_and_bounded_memory(drafter_dir):
    with serve_tiny(drafter_dir, APP, max_tokens_limit=64, max_waiting=MAX_WAITING) as url:
        (pid,) = replica_pids(APP)
        stop, peak = threading.Event(), [0]
        sampler = threading.Thread(target=sample_peak_rss, args=(pid, stop, peak), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        results = asyncio.run(burst(url))
        wall = time.monotonic() - t0
        stop.set()
        sampler.join()
        after = httpx.post(f"{url}/v1/chat/completions", headers=HEADERS, timeout=60,
                           json={"messages": [{"role": "user", "content": "and now?"}], "max_tokens": 8})

    errors = [r for r, _ in results if isinstance(r, Exception)]
    assert not errors, f"no client saw a broken connection: {errors[:3]}"
    accepted = [s for r, s in results if r.status_code == 200]
    shed = [(r, s) for r, s in results if r.status_code in (429, 503)]
    assert len(accepted) + len(shed) == CLIENTS, sorted({r.status_code for r, _ in results})
    assert accepted and shed, "the burst is more than one replica serves: some shed, the rest served"
    for resp, _ in shed:
        _check_error_shape(resp, resp.status_code)
        assert int(resp.headers["retry-after"]) >= 1
    assert max(s for _, s in shed) < min(10.0, max(accepted)), "shedding answers at once, not after the queue"
    for resp in (r for r, _ in results if r.status_code == 200):
        assert resp.json()["usage"]["completion_tokens"] >= 1
    assert after.status_code == 200, after.text
    assert 0 < peak[0] < MAX_RSS_BYTES, peak[0]
    p50, p99 = np.percentile(accepted, [50, 99])
    print(json.dumps({"clients": CLIENTS, "accepted": len(accepted), "shed": len(shed),
                      "shed_codes": sorted({r.status_code for r, _ in shed}), "p50_s": round(float(p50), 2),
                      "p99_s": round(float(p99), 2), "burst_wall_s": round(wall, 1),
                      "replica_peak_rss_mib": round(peak[0] / 2**20)}))
