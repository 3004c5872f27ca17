"""ktconvert.io.procstats: the peak RSS of this process and of its whole process tree (verify's and golden's run
reports), measured against children that allocate a known amount."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ktconvert.io.procstats import TreePeak, descendants, self_peak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MIB = 2**20
#: a child that writes every byte of 128 MiB, then waits so that samples see it
ALLOC = "import time; b = b'\\x01' * (128 << 20); time.sleep(0.4)"


#: the measuring process: a fresh interpreter, so that its own peak (VmHWM) is its own and not what a test worker
#: that ran other tests before reached
MEASURE = """
import json, subprocess, sys
from ktconvert.io.procstats import TreePeak
with TreePeak(interval=0.01) as peaks:
    before = peaks.sample()
    subprocess.run(json.loads(sys.argv[1]), check=True, timeout=60)
print(json.dumps({"before": before, **peaks.as_dict()}))
"""


@pytest.mark.parametrize("depth", ["child", "grandchild"])
def test_tree_peak_counts_a_descendant_allocation(depth):
    import json

    cmd = [sys.executable, "-c", ALLOC]
    if depth == "grandchild":  # a shell between us and the allocating process, as a launcher would be
        cmd = ["/bin/sh", "-c", f'"{sys.executable}" -c "{ALLOC}"; true']  # "; true": the shell stays the parent
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(cmd)], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    grown = got["peak_rss_tree"] - got["before"]
    # the child's 128 MiB, plus its interpreter (about 10 MiB), counted once (not per thread or per sample)
    assert 128 * MIB <= grown <= 128 * MIB + 48 * MIB, f"tree grew by {grown / MIB:.0f} MiB"
    assert got["peak_rss"] < got["peak_rss_tree"]  # the measuring process never held the child's bytes


def test_self_peak_is_this_process_and_the_tree_never_below_it():
    with TreePeak(interval=0.01) as peaks:
        block = b"\x01" * (64 * MIB)  # held by this process itself
        got = peaks.self_peak
        del block
    # VmHWM is monotone; the kernel syncs each thread's page counters lazily, so a read may lag by a few pages
    assert got >= 64 * MIB and self_peak() >= got - MIB
    assert peaks.tree_peak >= peaks.self_peak


def test_descendants_of_a_process_without_children_is_empty():
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"]) as child:
        assert child.pid in descendants(__import__("os").getpid())
        assert descendants(child.pid) == []
        child.wait(timeout=30)
