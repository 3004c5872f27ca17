"""Run the ktconvert CLI in a child process and read that process's own peak RSS.

The peak is the child's ``VmHWM``, read by the child itself as it exits: ``ru_maxrss`` (``os.wait4``,
``RUSAGE_CHILDREN``) would not do, because Linux carries a process's ``maxrss`` across ``fork`` and ``execve``, so a
child started from a large pytest process reports the parent's peak (a full suite run's pytest is past 600 MiB).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PROBE = ("import re, sys\nfrom ktconvert.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
         "    hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
         "    print('ktconvert-peak-kib', hwm, file=sys.stderr)\n")
REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], *, address_space: int | None = None, timeout: float = 120
            ) -> tuple[int, float, str, str]:
    """``(exit code, peak RSS in MiB, stdout, stderr without the probe's line)``. ``address_space``: an
    RLIMIT_AS for the child, so a regression fails there instead of taking the machine down."""
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    res = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, cwd=REPO, preexec_fn=limit if address_space else None)
    m = re.search(r"ktconvert-peak-kib (\d+)\n?", res.stderr)
    assert m, f"the child printed no peak (killed?): rc {res.returncode}\n{res.stderr[-2000:]}"
    err = res.stderr[:m.start()] + res.stderr[m.end():]
    return res.returncode, int(m.group(1)) / 1024, res.stdout, err
