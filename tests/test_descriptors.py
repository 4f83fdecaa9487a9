"""Reading a save of many rank files reserves their descriptors first (ucp.io.descriptors): the soft limit is raised
as far as the hard one allows, and past the hard one the reader refuses in one line before opening anything."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

PROBE = """
import resource
from ucp.errors import InputError
from ucp.io import descriptors
try:
    descriptors.reserve(500, "a save of 500 rank files")
except InputError as err:
    print("refused:", err)
else:
    print("soft:", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _probe(soft: int, hard: int) -> str:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_low_soft_limit_is_raised_to_what_the_files_need() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard descriptor limit here is {hard}: nothing to raise the soft one to")
    out = _probe(64, hard)
    assert out.startswith("soft:") and int(out.split()[1]) >= 2 * 500, out


def test_a_hard_limit_below_the_need_is_one_line_naming_it() -> None:
    out = _probe(64, 128)
    assert out.startswith("refused:") and "500 files" in out and "ulimit -Hn" in out and "128" in out, out
