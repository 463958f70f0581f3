"""The three Ray names outside its public API that pipelines/ use, each because no public one does the job,
still exist in the pinned Ray (this test fails loudly on a Ray upgrade that moves one, instead of the code
silently skipping what it did):
- ray._private.ray_constants.ENABLE_RAY_CLUSTER: read at import; a driver imported before the loopback env
  was set would rewrite 127.0.0.1 (pipelines/ray_cluster.init_ray);
- ray._private.authentication...: Ray caches its auth token per process, with no public reset
  (pipelines/ray_cluster._refresh_ray_auth);
- ray._private.state.actors: the actor table without a dashboard (ray.util.state needs one), to name what
  holds a cluster's CPUs (pipelines/actor_pool.resource_holders).
MLflow is used through public APIs only (dspark/io). Ray Serve's proxy-check variables (LOCAL_RAY_ENV) are
checked against the source of the module that reads them."""
import importlib
import os
import re

import pytest

from tests.paths import REPO


def test_the_private_ray_names_pipelines_use_still_exist():
    import ray._private.ray_constants as ray_constants
    from ray._private import state
    from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader, Config

    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool)
    assert callable(state.actors)
    assert callable(Config.initialize) and callable(AuthenticationTokenLoader.instance().reset_cache)


def test_no_other_private_ray_or_mlflow_name_is_used():
    private = re.compile(r"ray\._private[\w.]*|mlflow\.tracking\.context|\._(?:metric_objs|to_mlflow_entity)\b")
    found = {}
    for root in ("dspark", "pipelines", "jobs"):
        for path in (REPO / root).rglob("*.py"):
            for name in private.findall(path.read_text()):
                found.setdefault(name, set()).add(path.relative_to(REPO).as_posix())
    assert set(found) <= {"ray._private.ray_constants", "ray._private.authentication.authentication_token_setup",
                          "ray._private"}, found
    importlib.import_module("ray._private.authentication.authentication_token_setup")


def test_the_late_bound_serve_ingress_is_public_documented_api():
    """dspark/serve/deployment.py uses `@serve.ingress()` + `__serve_build_asgi_app__` (the app needs the replica's
    engine, built in __init__): Ray documents that form on its stable public `serve.ingress`."""
    from ray import serve

    doc = serve.ingress.__doc__
    assert "Pass nothing to defer the app to" in doc and "__serve_build_asgi_app__" in doc


class _Spawned(Exception):
    pass


def test_a_local_ray_gives_the_serve_proxy_the_patience_ray_serve_reads(monkeypatch, tmp_path):
    """LOCAL_RAY_ENV names variables Ray Serve reads at import (a rename would silently bring back the 10 s
    proxy checks a loaded 2-core machine misses), each above Ray's default; a job's own local Ray
    (`loopback_env`, before `ray.init`) and the stack's `ray start --head` both get them, unless the shell sets
    one itself."""
    from ray.serve._private import constants

    from dspark.devstack import stack
    from dspark.devstack.config import LOCAL_RAY_ENV, StackConfig
    from pipelines.ray_cluster import loopback_env

    source = open(constants.__file__).read()
    serve_env = {name: value for name, value in LOCAL_RAY_ENV.items() if name.startswith("RAY_SERVE_")}
    assert len(serve_env) == 2
    for name, value in serve_env.items():
        default = re.search(rf'"{name}",\s*([0-9.]+)', source)
        assert default and float(value) > float(default.group(1)), name
    for name in LOCAL_RAY_ENV:  # loopback_env writes os.environ itself: record each name, so teardown undoes it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    loopback_env()
    assert {name: os.environ[name] for name in LOCAL_RAY_ENV} == LOCAL_RAY_ENV

    def spawn(cmd, env, *args, **kw):
        raise _Spawned(env)

    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "7")  # what the user's shell sets wins
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    monkeypatch.setenv("DSPARK_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(stack, "_spawn", spawn)
    with pytest.raises(_Spawned) as spawned:
        stack.start_ray(StackConfig.from_env(), {"access_key_id": "k", "secret_access_key": "s"})
    env = spawned.value.args[0]
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == LOCAL_RAY_ENV["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]
    assert env["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "7"
