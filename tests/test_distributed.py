"""to-universal --distributed: torchrun ranks split the parameters; the output equals one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ucp
from ucp.harness.launch import free_port
from ucp.model.records import ParamMeta
from ucp.ops.distributed import assign


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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        port,
        "-m",
        "ucp",
        "to-universal",
        str(z3_bf16_dp2.path),
        str(multi),
        "--distributed",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads((single / "ucp.json").read_text()), json.loads((multi / "ucp.json").read_text())
    assert one["params"] == two["params"]  # same folders, shapes, steps and per-file crc32
    for entry in one["params"]:
        for name in entry["files"]:
            a = (single / "zero" / entry["folder"] / name).read_bytes()
            assert a == (multi / "zero" / entry["folder"] / name).read_bytes(), (entry["name"], name)
    assert not list(tmp_path.glob(".multi*")), "no staging folder left behind"


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_distributed_without_torchrun_is_one_clear_error(z3_bf16_dp2, tmp_path, capsys, monkeypatch):
    from ucp.cli import main

    for name in _LAUNCHER_ENV:  # as if no launcher had started this process, whatever runs pytest
        monkeypatch.delenv(name, raising=False)
    assert main(["to-universal", str(z3_bf16_dp2.path), str(tmp_path / "x"), "--distributed"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ucp: error: --distributed needs torchrun (or RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set"
    ]
    assert not (tmp_path / "x").exists()


def test_the_launcher_env_gives_rank_and_world_size(monkeypatch):
    """_init joins the group torchrun's variables describe (gloo) and reports this rank, the world
    size and whether it started the group; a group already running is reused, not restarted."""
    import torch.distributed as dist

    from ucp.ops.distributed import _init

    assert not dist.is_initialized()
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    got, rank, world, started = _init()
    try:
        assert (got, rank, world, started) == (dist, 0, 1, True)
        assert dist.get_backend() == "gloo"
        assert _init()[1:] == (0, 1, False)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
