"""The one HTTP health-polling helper: `http_ok` asks once, `wait_healthy` polls until a URL answers
200 (or a deadline passes) and returns the answer, with the last failure in the timeout message."""
from __future__ import annotations

from typing import Callable

import httpx
import tenacity


def http_ok(url: str, headers: dict | None = None, timeout: float = 3.0) -> bool:
    """True when GET `url` answers 200 within `timeout` seconds."""
    try:
        return httpx.get(url, headers=headers, timeout=timeout).status_code == 200
    except (httpx.HTTPError, ValueError):
        return False


def wait_healthy(url: str, timeout_s: float, headers: dict | None = None, interval_s: float = 1.0,
                 hint: str = "", ready: Callable[[httpx.Response], bool] = lambda resp: True) -> httpx.Response:
    """Poll GET `url` every `interval_s` until it answers 200 and `ready(response)` holds; return that
    response. Asks at least once; once `timeout_s` has passed after an answer that is not ready,
    raises TimeoutError naming the URL, the last answer or error, and `hint` (what to look at)."""
    last = ["no answer"]

    def ask() -> httpx.Response | None:
        try:
            resp = httpx.get(url, headers=headers, timeout=min(10.0, max(1.0, timeout_s)))
        except httpx.HTTPError as err:
            last[0] = f"{type(err).__name__}: {err}"
            return None
        if resp.status_code == 200 and ready(resp):
            return resp
        last[0] = f"HTTP {resp.status_code}: {resp.text[:200]}"
        return None

    def give_up(state: tenacity.RetryCallState) -> httpx.Response:
        raise TimeoutError(f"{url} was not healthy within {timeout_s:.0f} s ({last[0]})" + (f"; {hint}" if hint else ""))

    return tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(interval_s),
                             retry=tenacity.retry_if_result(lambda resp: resp is None),
                             retry_error_callback=give_up)(ask)
