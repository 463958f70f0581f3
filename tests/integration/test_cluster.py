"""Multi-node Ray on one machine (issue #24): see cluster_fixture.py."""
from __future__ import annotations

import os

import pytest

from cluster_fixture import ray_cluster, stack_services, wait_for  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_nodes_have_their_own_disks_and_die_by_pid(ray_cluster):
    import ray

    ray.init(address=ray_cluster.address)
    try:
        @ray.remote(num_cpus=0)
        def where():
            import tempfile
            return ray.get_runtime_context().get_node_id(), tempfile.gettempdir()

        seen = {name: ray.get(where.options(resources={name: 0.01}).remote()) for name in ("worker-a", "worker-b")}
        for name, (node_id, tmp) in seen.items():
            assert node_id == ray_cluster.nodes[name].node_id and tmp == str(ray_cluster.root / name / "tmp")
        killed = ray_cluster.kill("worker-a")
        assert killed
        wait_for(lambda: seen["worker-a"][0] not in ray_cluster.alive_node_ids(), 60, "worker-a dead")
        assert len(ray_cluster.alive_node_ids()) == 2
    finally:
        ray.shutdown()
