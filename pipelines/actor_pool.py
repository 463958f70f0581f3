"""Worker pools that never wait forever: every job that fans work out to Ray actors goes through here.

A Ray actor that asks for more than the cluster has free stays PENDING_CREATION with no message, and
whoever waits on it (ray.util.ActorPool, a Ray Data actor pool) waits forever. So:

1. `check_fit` compares what the workers ask for with `ray.available_resources()` before any start;
   if not even one fits it fails at once, naming what was asked, what is free and which actors hold
   the rest (a Serve replica, another job's workers, ...); if only some fit, only those start.
2. A worker that is not up within `start_timeout_s` is dropped; if none is up by then the job fails
   with the same message.
3. `map_unordered` (plain actors) only hands items to workers that are up, and puts the item of a
   worker that dies back in the queue for the others (each item at most `MAX_ATTEMPTS` times).
   `data_pool` is the same contract for a Ray Data actor pool (`ActorPoolStrategy`): the pool's
   resources are reserved as a placement group with a timeout (then released for the pool); Ray Data
   restarts a dead actor and retries its tasks itself.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

log = logging.getLogger("dspark.actor_pool")

MAX_ATTEMPTS = 2  # an item whose worker died is tried once more, on another worker
DEFAULT_START_TIMEOUT_S = 120.0
START_TIMEOUT_DESCRIPTION = (
    "seconds a worker may take to be placed and to load; workers not up by then are dropped (the others "
    "take their share); if none is up, the job fails naming the resources asked, free, and the actors "
    "holding them")


class WorkersUnavailable(RuntimeError):
    """The requested workers cannot start (or all died); the message says what holds the cluster."""


@dataclass(frozen=True)
class WorkerAsk:
    """What a pool of `count` workers asks for, each `num_cpus` CPUs and `num_gpus` GPUs."""

    what: str  # e.g. "evaluation workers", named in messages
    count: int
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    config_hint: str = ""  # the config fields to change, e.g. "workers.num_workers / workers.num_cpus"

    def per_worker(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if v > 0}


# ---- pure helpers (no Ray) -----------------------------------------------------------------------
def fit_count(per_worker: dict[str, float], free: dict[str, float]) -> int:
    """How many workers asking `per_worker` fit into `free` (summed over nodes, so an upper bound
    when a worker cannot span nodes; the start timeout catches the rest). A worker asking for
    nothing always fits."""
    counts = [math.floor(free.get(key, 0.0) / amount + 1e-9) for key, amount in per_worker.items() if amount > 0]
    return min(counts) if counts else 1 << 30


def target_actor_spec(cfg, sampling, **extra) -> dict:
    """What a target-loading actor is built from (rollouts and Magpie synthesis): the stage config's target,
    its compute section (dtype "auto" is resolved by the actor, on its own device), `sampling` and `extra`."""
    c = cfg.compute
    return {"target": cfg.target, "dtype": c.dtype, "device": c.device,
            "threads": c.torch_threads or max(1, int(c.num_cpus)), "sampling": sampling.model_dump(),
            "max_context_tokens": cfg.max_context_tokens, **extra}


def _fmt_resources(resources: dict[str, float], keys: Iterable[str] | None = None) -> str:
    """CPUs and GPUs (the resources workers ask for; memory and node labels are left out).
    `keys`: show these even when zero."""
    keys = list(keys) if keys is not None else [k for k in ("CPU", "GPU") if resources.get(k)]
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in keys) or "nothing"


def shortage_message(ask: WorkerAsk, free: dict, total: dict, holders: list[str], detail: str = "") -> str:
    """One paragraph: asked, free, total, who holds it, what to do."""
    keys = ask.per_worker()
    asked = {k: v * ask.count for k, v in keys.items()}
    held = "; ".join(holders) if holders else "no live actor holds any (tasks or placement groups may)"
    hint = f"lower {ask.config_hint}, " if ask.config_hint else "ask for fewer resources, "
    fmt = _fmt_resources
    return (f"cannot start {ask.what}: asked for {ask.count} x ({fmt(ask.per_worker())}) = {fmt(asked)}; "
            f"the cluster has {fmt(total, keys)}, of which {fmt(free, keys)} free. Held by: {held}. {detail}"
            f"Free those resources (e.g. `serve shutdown` for a Serve deployment), {hint}"
            f"or raise the start timeout.").replace("  ", " ")


def _holder_line(name: str, klass: str, resources: dict | None, job: str | None) -> str:
    label = f"{klass} {name!r}" if name else klass
    held = f" holding {_fmt_resources(resources)}" if resources else ""
    return f"{label}{held}" + (f" (job {job})" if job else "")


# ---- cluster state (Ray) ---------------------------------------------------------------------------
def cluster_free() -> tuple[dict[str, float], dict[str, float]]:
    """(free, total) resources of the connected cluster (connecting as the jobs do if not yet)."""
    import ray

    if not ray.is_initialized():
        from pipelines.ray_cluster import init_ray  # $RAY_ADDRESS or a local Ray, never auto-detected
        from dspark.config import RayConfig

        init_ray(RayConfig())
    return dict(ray.available_resources()), dict(ray.cluster_resources())


def resource_holders(limit: int = 12) -> list[str]:
    """Live actors and what they hold: the state API (needs the dashboard) with resources, else the
    GCS actor table (names only). The address is the connected cluster's, never auto-detected."""
    import ray

    try:
        from ray.util.state import list_actors

        actors = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")],
                             detail=True, limit=1000, raise_on_missing_output=False, timeout=10)
        lines = [_holder_line(a.name or "", a.class_name, a.required_resources, a.job_id) for a in actors
                 if a.required_resources]
    except Exception as err:  # noqa: BLE001 - no dashboard (local Ray) or an older API: use the GCS table
        log.debug("state API unavailable (%s); listing actors from the GCS", err)
        from ray._private import state

        lines = [_holder_line(a.get("Name") or "", a.get("ActorClassName", "?"), None, a.get("JobID"))
                 for a in state.actors().values() if a.get("State") == "ALIVE"]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def check_fit(ask: WorkerAsk) -> int:
    """Number of workers to start: min(ask.count, how many fit the free resources). Raises
    WorkersUnavailable, naming what holds the cluster, when not one fits."""
    free, total = cluster_free()
    fits = fit_count(ask.per_worker(), free)
    if fits >= ask.count:
        return ask.count
    if fits == 0:
        never = fit_count(ask.per_worker(), total) == 0
        detail = "Even an empty cluster could not place one. " if never else ""
        raise WorkersUnavailable(shortage_message(ask, free, total, resource_holders(), detail))
    log.warning("starting %d of %d %s: only that many fit the free resources (%s free); held by: %s",
                fits, ask.count, ask.what, _fmt_resources(free), "; ".join(resource_holders()) or "-")
    return fits


# ---- plain actor pools -----------------------------------------------------------------------------
@dataclass
class _Item:
    index: int
    value: Any
    attempts: int = 0


def map_unordered(start_worker: Callable[[], Any], call: Callable[[Any, Any], Any], items: Iterable,
                  ask: WorkerAsk, start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> Iterator[Any]:
    """Yield `ray.get(call(worker, item))` for every item, in completion order, over up to
    `ask.count` actors made by `start_worker()` (see the module doc for the guarantees).
    Errors raised by the work itself propagate; the actors are killed at the end."""
    import ray

    queue = deque(_Item(i, v) for i, v in enumerate(items))
    if not queue:
        return
    ask = WorkerAsk(ask.what, min(ask.count, len(queue)), ask.num_cpus, ask.num_gpus, ask.config_hint)
    starting = {}  # ready ref -> actor
    for _ in range(check_fit(ask)):
        actor = start_worker()
        starting[actor.__ray_ready__.remote()] = actor
    idle, running, lost = [], {}, []  # running: result ref -> (actor, item); lost: why workers went
    deadline = time.monotonic() + start_timeout_s
    try:
        while queue or running:
            while queue and idle:
                actor, item = idle.pop(), queue.popleft()
                item.attempts += 1
                running[call(actor, item.value)] = (actor, item)
            if not running and not starting:
                raise WorkersUnavailable(_all_lost_message(ask, lost))
            wait_s = max(0.0, deadline - time.monotonic()) if starting else None
            done, _ = ray.wait(list(starting) + list(running), num_returns=1, timeout=wait_s)
            for ref in done:
                if ref in starting:
                    _on_started(ref, starting.pop(ref), idle, lost)
                else:
                    actor, item = running.pop(ref)
                    result = _result_or_requeue(ref, actor, item, queue, lost)
                    if result is not _LOST:
                        idle.append(actor)
                        yield result
            if starting and time.monotonic() >= deadline:
                _drop_unstarted(starting, lost, start_timeout_s, ask)
    finally:
        for actor in list(starting.values()) + idle + [a for a, _ in running.values()]:
            ray.kill(actor)


_LOST = object()


def _on_started(ref, actor, idle: list, lost: list) -> None:
    import ray

    try:
        ray.get(ref)
        idle.append(actor)
    except ray.exceptions.RayActorError as err:  # the constructor raised or the process died
        lost.append(f"a worker failed to start: {_first_line(err)}")
        log.warning("a worker failed to start: %s", err)


def _result_or_requeue(ref, actor, item: _Item, queue: deque, lost: list):
    """The item's result; or, when its worker died, put the item back (up to MAX_ATTEMPTS) -> _LOST."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as err:  # died, or unreachable (ActorUnavailableError)
        lost.append(f"a worker died on item {item.index}: {_first_line(err)}")
        ray.kill(actor)
        if item.attempts >= MAX_ATTEMPTS:
            raise WorkersUnavailable(f"item {item.index} lost its worker {item.attempts} times; last: "
                                     f"{_first_line(err)}") from err
        log.warning("a worker died on item %d; giving it to another worker (%s)", item.index, _first_line(err))
        queue.appendleft(item)
        return _LOST


def _drop_unstarted(starting: dict, lost: list, timeout_s: float, ask: WorkerAsk) -> None:
    import ray

    for ref, actor in list(starting.items()):
        ray.kill(actor)
        del starting[ref]
        lost.append(f"a worker was not up after {timeout_s:g} s")
    log.warning("%s: dropped the workers not up after %g s; the others take their share", ask.what, timeout_s)


def _all_lost_message(ask: WorkerAsk, lost: list[str]) -> str:
    free, total = cluster_free()
    reasons = "; ".join(dict.fromkeys(lost)) or "none started"
    return shortage_message(ask, free, total, resource_holders(), detail=f"No worker is up ({reasons}). ")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


# ---- Ray Data actor pools --------------------------------------------------------------------------
@contextmanager
def data_pool(ask: WorkerAsk, start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> Iterator[dict]:
    """Yields `map_batches` keyword arguments (`compute`) for an actor pool of the workers that fit.
    Their resources are first reserved as a placement group: if it is not placed within
    `start_timeout_s`, WorkersUnavailable names asked / free / holders and nothing is left pending (a
    Ray Data actor left pending would start later and hold its CPUs). Once placed, the group is
    released and Ray Data places the actors itself, with `wait_for_min_actors_s` = the start timeout
    covering a race for the freed resources. The actors do not run inside the group: a group whose
    node dies reserves its lost bundle again before anything may use the group, so a replica lost with
    its node could only restart once a whole bundle fits again, and its in-flight batches (and, with
    ordered output, every batch behind them) would wait for that — forever on a fixed cluster. Outside
    a group the lost replica restarts wherever it fits (on a surviving node once the others drain the
    input, or on a replacement node) and Ray Data retries its batches there."""
    import ray
    import ray.data
    from ray.util.placement_group import placement_group, remove_placement_group

    size = check_fit(ask)
    group = placement_group([ask.per_worker() or {"CPU": 0.001}] * size, strategy="PACK")
    try:
        ready, _ = ray.wait([group.ready()], timeout=start_timeout_s)
        if not ready:
            free, total = cluster_free()
            raise WorkersUnavailable(shortage_message(ask, free, total, resource_holders(),
                                                      detail=f"Not placed after {start_timeout_s:g} s. "))
    finally:
        remove_placement_group(group)
    ctx = ray.data.DataContext.get_current()
    saved = ctx.wait_for_min_actors_s
    ctx.wait_for_min_actors_s = max(1, math.ceil(start_timeout_s))
    try:
        yield {"compute": ray.data.ActorPoolStrategy(size=size)}
    finally:
        ctx.wait_for_min_actors_s = saved
