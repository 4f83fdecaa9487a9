"""to-universal --distributed: torchrun ranks split the parameters; the output equals one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ucp
from ucp.ops.distributed import assign
from ucp.harness.launch import free_port
from ucp.model.records import ParamMeta


def test_assign_balances_by_size_and_covers_every_parameter_once():
    metas = [ParamMeta(f"p{i}", (n,), "fp32", 0, False) for i, n in enumerate([100, 90, 10, 10, 5, 1, 80])]
    shares = assign(metas, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(metas)))
    loads = [sum(metas[i].numel for i in share) for share in shares]
    assert max(loads) - min(loads) <= 100
    assert assign(metas, 3) == shares  # deterministic: every rank computes the same split


def test_two_gloo_ranks_write_the_same_files_as_one_process(z3_bf16_dp2, tmp_path):
    single = tmp_path / "single"
    ucp.to_universal(z3_bf16_dp2.path, single)
    multi = tmp_path / "multi"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(free_port())  # torchrun's static rendezvous hangs on port 0 (torch 2.13)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           "-m", "ucp", "to-universal", str(z3_bf16_dp2.path), str(multi), "--distributed"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads((single / "ucp.json").read_text()), json.loads((multi / "ucp.json").read_text())
    assert one["params"] == two["params"]  # same folders, shapes, steps and per-file crc32
    for entry in one["params"]:
        for name in entry["files"]:
            a = (single / "zero" / entry["folder"] / name).read_bytes()
            assert a == (multi / "zero" / entry["folder"] / name).read_bytes(), (entry["name"], name)
    assert not list(tmp_path.glob(".multi*")), "no staging folder left behind"


def test_distributed_without_torchrun_is_one_clear_error(z3_bf16_dp2, tmp_path, capsys):
    from ucp.cli import main

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if "RANK" in os.environ:
        pytest.skip("running under a launcher")
    assert env is not None
    assert main(["to-universal", str(z3_bf16_dp2.path), str(tmp_path / "x"), "--distributed"]) == 2
    assert "torchrun" in capsys.readouterr().err
