"""The simulated cluster: namespaced nodes, a shaped link, a real 2-node training, cleanup."""

import subprocess
import sys

import pytest

from conftest import REPO, TINY, read_metrics

sys.path.insert(0, str(REPO / "benchmarks"))
from simcluster import SimCluster, SimClusterError, available  # noqa: E402

pytestmark = pytest.mark.skipif(available() is not None, reason=f"simulated cluster: {available()}")


def _host_links() -> set:
    return set(subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.split("\n"))


def test_two_node_training_on_a_shaped_link_cleans_up(tmp_path, cache_dir):
    """Guards against a simulated cluster that leaks namespaces or veths, does not shape
    the link, or cannot rendezvous: 2 nodes x 1 rank train a few steps over a 1 Gbit/s
    tbf link, the qdisc is in place while it runs, and nothing is left afterwards."""
    links_before = _host_links()
    metrics = tmp_path / "m.jsonl"
    with SimCluster(2, rate="1gbit") as cluster:
        qdisc = subprocess.run(["ip", "netns", "exec", cluster.node_ns[0], "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        assert sorted(cluster.leftovers()) == sorted([cluster.bridge_ns, *cluster.node_ns])
        cluster.run_torchrun(["pretrain_gpt.py", *TINY, "--train-iters", "3", "--loco-bits", "4",
                              "--data-cache-path", cache_dir, "--metrics-jsonl", str(metrics)],
                             nproc_per_node=1, timeout=300, env={"OMP_NUM_THREADS": "1"}, log_dir=tmp_path)
    assert cluster.leftovers() == []
    assert _host_links() == links_before
    rows = [m for m in read_metrics(metrics) if "train/lm_loss" in m]
    assert [m["iteration"] for m in rows] == [1, 2, 3]
    assert rows[-1]["comm/compressed_fraction"] == 1.0


def test_failure_and_timeout_still_clean_up(tmp_path):
    """Guards against a crashed or hung run leaving namespaces behind (or hanging CI)."""
    crash = tmp_path / "crash.py"
    crash.write_text("import sys; sys.exit(3)\n")
    hang = tmp_path / "hang.py"
    hang.write_text("import time; time.sleep(600)\n")
    for script, match in ((crash, "exited with"), (hang, "timed out")):
        with pytest.raises(SimClusterError, match=match):
            with SimCluster(2, rate=None) as cluster:
                cluster.run_torchrun([str(script)], nproc_per_node=1, timeout=20)
        assert cluster.leftovers() == []
