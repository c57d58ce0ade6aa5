"""Benchmarks' --smoke modes run, so the scripts cannot rot."""

import subprocess
import sys

from conftest import REPO


def test_loco_bucket_smoke():
    """Guards against the bucket benchmark breaking, and against the 4-bit payload
    drifting above the spec's 0.27 x bf16."""
    proc = subprocess.run([sys.executable, "benchmarks/loco_bucket.py", "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(l for l in proc.stdout.splitlines() if l.startswith("LoCo 4-bit"))
    assert float(row.split()[-1]) <= 0.27
    assert "compress+decompress" in proc.stdout
