"""The environment on both sides: the one every measured child gets, and the one recorded with the results.

Both are asked for by fixtures, measurement and the entry point; neither imports the libraries it names,
so that the benchmark process stays light.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from typing import Any

from .common import REPO


def tool_env() -> dict[str, str]:
    """The same environment for every measured child: CPU accelerator, this checkout first on the path."""
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def git_commit() -> str:
    """The checkout's short commit, ``+dirty`` when ucp/ has uncommitted changes; "" without git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "ucp"], capture_output=True, text=True, check=False
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = "", False
    return commit + ("+dirty" if dirty else "")


def _ucp_cli_imports() -> list[str] | None:
    """Which of torch/deepspeed ``import ucp.cli`` pulls in, from a child; None when the import fails."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, json, ucp.cli; "
            "print(json.dumps(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)))",
        ],
        capture_output=True,
        text=True,
        env=tool_env(),
        cwd=REPO,
        check=False,
    )
    return json.loads(probe.stdout) if probe.returncode == 0 and probe.stdout.strip() else None


def environment() -> dict[str, Any]:
    """What the numbers depend on, recorded next to them (library versions from metadata, not imports)."""
    commit = git_commit()
    cli_imports = _ucp_cli_imports()
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "deepspeed": version("deepspeed"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "ucp_commit": commit,
        # ucp's CLI should not pull DeepSpeed in; the work numbers assume it imports torch only
        "ucp_cli_imports": cli_imports,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
