"""A replica asked to stop finishes its in-flight streams (slow tier, a real Ray Serve deployment of `tiny`):
the application is deleted while 4 streams run; each stream still ends with its last token and [DONE]
(deployment.graceful_shutdown_timeout_s, default 300 s, lets the replica drain before it is stopped)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.integration.serve_deployment import HEADERS, serve_tiny
from tests.integration.test_replica_kill import stream
from tests.unit.serve.test_serve import drafter_dir, tiny  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
APP = "dspark-drain"
STREAMS = 4


@pytest.mark.parametrize("graceful_s", [None, 0.2])  # the serve config's default (300 s), and a control
def test_a_replica_asked_to_stop_finishes_its_in_flight_streams(drafter_dir, graceful_s):
    from ray import serve

    with serve_tiny(drafter_dir, APP, graceful_shutdown_s=graceful_s) as url:
        outcomes = [{} for _ in range(STREAMS)]
        started = [threading.Event() for _ in range(STREAMS)]
        clients = [threading.Thread(target=stream, args=(url, HEADERS, o, e), daemon=True)
                   for o, e in zip(outcomes, started)]
        for client in clients:
            client.start()
        assert all(e.wait(60) for e in started), outcomes
        asked_at = time.monotonic()
        serve.delete(APP, _blocking=True)  # the replica is told to stop with streams in flight
        for client in clients:
            client.join(timeout=120)
    if graceful_s is not None:  # the control: a replica given 0.2 s cuts its streams, so the setting is what drains
        assert any(o.get("end") != "done" for o in outcomes), outcomes
        return
    assert all(o.get("end") == "done" for o in outcomes), outcomes
    assert all(o["events"] >= 10 for o in outcomes), outcomes  # whole answers, not a cut stream
    print(json.dumps({"streams": STREAMS, "ends": [o["end"] for o in outcomes],
                      "drained_s": round(max(o["at"] for o in outcomes) - asked_at, 2)}))
