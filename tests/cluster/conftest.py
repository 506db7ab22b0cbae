"""A Ray cluster on this machine: a head and two worker nodes, each its own
raylet with its own resources, the way separate machines would be.

    head      {"spare": 1}                      a spare place for the target
    target    {"target_node": 1}                where the target goes
    draft     {"draft_node": 1}, labels role=draft   where drafters go

`ray_cluster` (one per test module) sets RAY_ADDRESS, so `address: auto`
finds it as it would a cluster started with `ray start --head`. At teardown
it shuts Ray down and checks that no raylet, GCS or worker process it
started is left running.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import pytest

from helpers.ray_procs import ray_daemons, ray_processes

import ray  # the [ray] extra, part of [test]
from ray.cluster_utils import Cluster

NODES = {"target": dict(num_cpus=2, resources={"target_node": 1}),
         "draft": dict(num_cpus=2, resources={"draft_node": 1}, labels={"role": "draft"})}


@dataclass
class LocalCluster:
    cluster: Cluster
    nodes: dict  # name -> ray node handle

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def kill(self, name: str) -> None:
        """The node dies at once, as a machine would: every worker process on it
        (SIGKILL; an orphaned worker would otherwise serve calls for a while),
        then its raylet."""
        node = self.nodes[name]
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for proc in raylet.children(recursive=True):
            proc.kill()
        self.cluster.remove_node(node, allow_graceful=False)

    def revive(self, name: str) -> None:
        """A new node with the same resources (a replaced machine)."""
        self.nodes[name] = self.cluster.add_node(**NODES[name])
        self.cluster.wait_for_nodes()


@pytest.fixture(scope="module")
def ray_cluster():
    before = {p.pid for p in ray_processes()}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"spare": 1}})
    nodes = {name: cluster.add_node(**args) for name, args in NODES.items()}
    nodes["head"] = cluster.head_node
    cluster.wait_for_nodes()
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield LocalCluster(cluster, nodes)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
    left = [p for p in ray_processes() if p.pid not in before]
    gone, alive = psutil.wait_procs(left, timeout=60)  # a loaded 2-core host is slow to reap
    assert not alive, f"Ray processes left running after shutdown: {[' '.join(p.cmdline())[:120] for p in alive]}"


@pytest.fixture
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import ray

    ray.shutdown()
    if ray_daemons():
        pytest.fail(f"a Ray cluster is running on this host (pids {sorted(ray_daemons())}): "
                    "these tests need none; stop it with `ray stop`")
