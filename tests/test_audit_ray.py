"""``rrh audit --executor ray`` on a real two-node Ray cluster, on loopback.

Two Ray nodes of one CPU each (``ray.cluster_utils.Cluster``: a head and a worker node, each its
own raylet and object store) audit a generated run with every fault planted, one task per unit
of work; the result must be exactly the serial audit's, floats and offenders' places included.
Marked ``slow`` (starting two raylets is ~25 s of one core, an eighth of the default run);
``.ci/run`` runs it as its own step. Skipped when Ray (the ``ray`` extra) is not installed, unless
``RRH_REQUIRE_RAY=1`` (``.ci/run``'s Ray step), which makes a missing Ray a failure. Every wait is
bounded, so a node that does not come up or dies fails the test in minutes, never hangs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("RRH_REQUIRE_RAY") == "1":
    import ray
else:
    ray = pytest.importorskip("ray")
pytest.importorskip("pyarrow")

from ray.cluster_utils import Cluster

from harness.audit import audit_run
from harness.audit.synthetic.generate import FAULTS, RunShape, generate_run

pytestmark = pytest.mark.slow

SHAPE = RunShape(
    steps=3, prompts=3, group_size=3, prompt_len=7, response_len=9, layers=5, experts=16, top_k=4
)
NODE = {"num_cpus": 1, "object_store_memory": 100 << 20}
"""One CPU per node, so tasks spread over both; a small object store (the states are small)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(
        initialize_head=True, connect=False, head_node_args={**NODE, "include_dashboard": False}
    )
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes(timeout=90)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_a_two_node_cluster_audits_a_run_exactly_as_the_serial_executor(
    cluster: Cluster, tmp_path: Path
) -> None:
    planted = generate_run(tmp_path, SHAPE, seed=11, faults=FAULTS, file_bytes=6_000, row_group_bytes=2_500)
    serial = audit_run(tmp_path, executor="serial", unit_bytes=1).as_dict()
    on_ray = audit_run(tmp_path, executor="ray", ray_address=cluster.address, unit_bytes=1).as_dict()
    assert on_ray == serial
    assert not ray.is_initialized()  # the executor leaves no connection behind
    violated = {r["name"] for r in on_ray["invariants"] if r["status"] == "violated"}
    assert {f.invariant for f in planted} <= violated

    # Both nodes were up and are still alive: the tasks had two raylets to run on.
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        assert sum(1 for node in ray.nodes() if node["Alive"]) == 2
    finally:
        ray.shutdown()
