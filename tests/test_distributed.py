"""to-universal --distributed: torchrun ranks split the parameters; the output equals one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _two_nodes(*argv: str, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``python -m ucp ARGV --distributed`` as 2 nodes x 2 processes on this machine: two torchrun
    launches with --nnodes 2 and their own --node-rank, meeting at one master port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "-m",
                "ucp",
                *argv,
                "--distributed",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
    ]
    done = []
    for launch in launches:
        out, err = launch.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(launch.args, launch.returncode, out, err))
    return done


def _same_files(a, b) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.slow
@pytest.mark.parametrize(
    "verb, stage",
    [("restore", "3"), ("restore", "2"), ("restore", "0"), ("reshard", None)],
    ids=["restore-z3", "restore-z2", "restore-z0", "reshard"],
)
def test_two_nodes_of_two_write_the_same_native_checkpoint_as_one_process(
    z3_bf16_dp2, universals, tmp_path, verb, stage
):
    """restore / reshard --distributed on 2 nodes x 2 processes: byte-identical to one process's output."""
    from ucp.cli import main

    src = str(universals("z3-bf16-dp2-adamw") if verb == "restore" else z3_bf16_dp2.path)
    flags = ["--dp", "3"] + (["--stage", stage] if stage else [])
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert main(["-q", verb, src, str(single), *flags]) == 0
    done = _two_nodes(verb, src, str(multi), *flags)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    _same_files(single, multi)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multi", "single"], "no staging folder left behind"


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["3", "0"])
def test_a_damaged_source_file_fails_every_node_and_writes_nothing(universals, tmp_path, stage):
    """The source files are checked by the process whose share holds them; its failure stops them all (at stage 0
    one process writes the one file, and the others still check their shares)."""
    import shutil

    from tests.test_restore_stream import _flip, _victim

    root = tmp_path / "u"
    shutil.copytree(universals("z3-bf16-dp2-adamw"), root)
    # the largest file, checked by process 0 (which writes the one stage-0 file), and one process 3 checks
    _flip(_victim(root), "tensor") if stage == "3" else _flip(_checked_by(root, process=3, world=4), "tensor")
    done = _two_nodes("restore", str(root), str(tmp_path / "out"), "--dp", "3", "--stage", stage)
    assert all(d.returncode != 0 for d in done), [d.returncode for d in done]
    errors = "\n".join(d.stderr for d in done)
    lines = [line for line in errors.splitlines() if line.startswith("ucp: error: ")]
    assert len(lines) == 4 and all("does not match its checksum" in line for line in lines), errors[-3000:]
    # torchrun prints its own traceback (ChildFailedError) for a failed child; none comes from ucp's code
    frames = [line for line in errors.splitlines() if line.strip().startswith('File "')]
    assert not [f for f in frames if "/ucp/" in f], frames
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u"], "no OUT and no staging folder"


def _checked_by(root: Path, *, process: int, world: int) -> Path:
    """The exp_avg.pt of a trained parameter whose source files process ``process`` of ``world`` checks."""
    from ucp.sources import open_reader

    with open_reader(root) as reader:
        metas = reader.facts.params
        name = next(metas[i].name for i in assign(metas, world)[process] if not metas[i].frozen)
    entry = next(p for p in json.loads((root / "ucp.json").read_text())["params"] if p["name"] == name)
    return root / "zero" / entry["folder"] / "exp_avg.pt"
