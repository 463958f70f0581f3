"""The one HTTP health-polling helper: `http_ok` asks once, `wait_healthy` polls until a URL answers
200 (or a deadline passes) and returns the answer, with the last failure in the timeout message."""
from __future__ import annotations

import time
from typing import Callable

import httpx


def http_ok(url: str, headers: dict | None = None, timeout: float = 3.0) -> bool:
    """True when GET `url` answers 200 within `timeout` seconds."""
    try:
        return httpx.get(url, headers=headers, timeout=timeout).status_code == 200
    except (httpx.HTTPError, ValueError):
        return False


def wait_healthy(url: str, timeout_s: float, headers: dict | None = None, interval_s: float = 1.0,
                 hint: str = "", ready: Callable[[httpx.Response], bool] = lambda resp: True) -> httpx.Response:
    """Poll GET `url` until it answers 200 and `ready(response)` holds; return that response. Raises
    TimeoutError naming the URL, the last answer or error, and `hint` (what to look at)."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            resp = httpx.get(url, headers=headers, timeout=min(10.0, max(1.0, timeout_s)))
            if resp.status_code == 200 and ready(resp):
                return resp
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} was not healthy within {timeout_s:.0f} s ({last})"
                               + (f"; {hint}" if hint else ""))
        time.sleep(interval_s)
