"""The Python API holds the CLI's promise: no writer writes over, into or around one of its inputs.

Every writing function of the API (to_universal, write_native, reshard, write_dcp, export to a folder and to a
file, write_pipeline, write_moe, write_autoep, run_migration; write_hf in tests/test_hf.py) is called with
``overwrite=True`` on an OUT that is its input, lies inside it, holds it, or names it through a symlink or a bind
mount; each is refused with one UcpError, and the input stays byte for byte as it was, with nothing beside it.
Inputs are real DeepSpeed checkpoints (the suite's cached runs) or the universal directory ucp made of one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ucp
from tests.support.fixtures import Built
from tests.test_reliability import digests
from ucp.errors import OutputExistsError, OutputOverlapError, UcpError
from ucp.io.atomic import owner_kind
from ucp.io.guard import OutputPolicy
from ucp.migrate import run_migration
from ucp.sources import open_reader
from ucp.targets.autoep import write_autoep
from ucp.targets.export import export
from ucp.targets.moe import write_moe
from ucp.targets.pipeline import PipelineLayout, write_pipeline

Writer = Callable[..., Any]


def _migrate(src: Path, out: Path, **kw: Any) -> Any:
    config = src.parent.parent / "cfg" / "m.yaml"  # beside the box that holds the input
    config.parent.mkdir(exist_ok=True)
    config.write_text(f"source: {json.dumps(str(src))}\ntarget: {{dp: 1, output: {json.dumps(str(out))}}}\n")
    return run_migration(config, overwrite=bool(kw.get("overwrite")))


#: name -> (which input it reads, the call); every writer of the API, on its cheapest real input
WRITERS: dict[str, tuple[str, Writer]] = {
    "to_universal": ("ckpt", lambda s, o, **kw: ucp.to_universal(s, o, workers=1, **kw)),
    "write_native": ("universal", lambda s, o, **kw: ucp.write_native(s, o, dp=2, **kw)),
    "reshard": ("ckpt", lambda s, o, **kw: ucp.reshard(s, o, dp=1, **kw)),
    "write_dcp": ("universal", lambda s, o, **kw: ucp.write_dcp(s, o, **kw)),
    "export": ("universal", lambda s, o, **kw: export(s, o, **kw)),
    "export-file": ("universal", lambda s, o, **kw: export(s, o / "w.safetensors", **kw)),
    "run_migration": ("ckpt", _migrate),
}


@pytest.fixture(scope="module")
def universal(z3_bf16_dp2: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("universal") / "u"
    ucp.to_universal(z3_bf16_dp2.path, out, workers=1)
    return out


def _input(kind: str, box: Path, ckpt: Built, universal: Path) -> Path:
    return Path(shutil.copytree(ckpt.path if kind == "ckpt" else universal, box / "in"))


def _outs(inp: Path, box: Path) -> dict[str, Path]:
    """Every OUT that overlaps ``inp``: itself, a folder inside it, its parent, and the same through a symlink."""
    (box / "link").symlink_to(inp)
    (box / "up").symlink_to(box)
    return {
        "self": inp,
        "child": inp / "sub",
        "parent": box,
        "symlink": box / "link",
        "inside-symlink": box / "link" / "sub",
        "parent-symlink": box / "up",
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WRITERS))
def test_every_api_writer_refuses_an_output_overlapping_its_input(
    z3_bf16_dp2: Built, universal: Path, tmp_path: Path, name: str
) -> None:
    kind, write = WRITERS[name]
    box = tmp_path / "box"
    inp = _input(kind, box, z3_bf16_dp2, universal)
    outs = _outs(inp, box)
    if name == "export-file":  # a file OUT in the input or in a folder of it (the file itself goes inside)
        outs = {k: v for k, v in outs.items() if k in ("self", "child", "symlink", "inside-symlink")}
    for relation, out in outs.items():
        before = digests(box)
        with pytest.raises(UcpError, match="overlaps the") as caught:
            write(inp, out, overwrite=True)
        assert "\n" not in str(caught.value), relation
        assert digests(box) == before, f"{relation}: an input changed"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cfg") == ["box"], relation


@pytest.mark.slow
@pytest.mark.parametrize("name", ["to_universal", "write_native", "export"])
def test_an_api_writer_sees_another_name_of_the_same_folder(
    z3_bf16_dp2: Built, universal: Path, tmp_path: Path, name: str
) -> None:
    """A bind mount: a second path to the same folder, which only (device, inode) tells."""
    kind, write = WRITERS[name]
    box = tmp_path / "box"
    inp = _input(kind, box, z3_bf16_dp2, universal)
    alias = tmp_path / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(inp), str(alias)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root); the symlink cases cover the rest")
    try:
        before = digests(box)
        for out in (alias, alias / "sub"):
            with pytest.raises(OutputOverlapError):
                write(inp, out, overwrite=True)
        assert digests(box) == before
    finally:
        subprocess.run(["umount", str(alias)], check=True)


@pytest.mark.slow
def test_the_examples_of_the_report_are_refused(z3_bf16_dp2: Built, universal: Path, tmp_path: Path) -> None:
    """``to_universal("ck/global_step3", "ck", overwrite=True)`` and ``write_native(U, U, overwrite=True)``."""
    ck = Path(shutil.copytree(z3_bf16_dp2.path, tmp_path / "ck"))
    u = Path(shutil.copytree(universal, tmp_path / "u"))
    before = digests(tmp_path)
    tag = ck / (ck / "latest").read_text().strip()
    with pytest.raises(OutputOverlapError, match="holds it"):
        ucp.to_universal(tag, ck, overwrite=True)
    with pytest.raises(OutputOverlapError, match="both name the same place"):
        ucp.write_native(u, u, overwrite=True, dp=2)
    with open_reader(u) as reader:  # an open reader knows its files too
        with pytest.raises(OutputOverlapError):
            ucp.write_native(reader, u / "n", dp=2)
    assert digests(tmp_path) == before


@pytest.mark.parametrize(
    "name, call",
    [
        (
            "write_pipeline",
            lambda s, o, **kw: write_pipeline(
                s, o, PipelineLayout(parts=(0, 3, 6), tied={"embed": (0, 5)}), dp=1, stage=1, **kw
            ),
        ),
        ("write_moe", lambda s, o, **kw: write_moe(s, o, dp=4, ep=2, stage=2, **kw)),
        ("write_autoep", lambda s, o, **kw: write_autoep(s, o, dp=4, ep=2, stage=2, **kw)),
    ],
)
@pytest.mark.slow
def test_the_layout_writers_refuse_an_output_overlapping_their_input(
    tmp_path: Path, name: str, call: Writer, request: pytest.FixtureRequest
) -> None:
    source = request.getfixturevalue(f"{name}_source")
    box = tmp_path / "box"
    inp = Path(shutil.copytree(source, box / "in"))
    for relation, out in _outs(inp, box).items():
        before = digests(box)
        with pytest.raises(UcpError, match="overlaps the"):
            call(inp, out, overwrite=True)
        assert digests(box) == before, f"{relation}: an input changed"


@pytest.fixture(scope="module")
def write_pipeline_source() -> Path:
    from tests.support.pipeline_runs import build_pipe

    return build_pipe(pp=2, dp=2, stage=1, dtype="fp32").path


@pytest.fixture(scope="module")
def write_moe_source() -> Path:
    from tests.support.moe_runs import build_moe

    return build_moe(world=4, ep=2, experts=4, stage=2, dtype="fp32").path


@pytest.fixture(scope="module")
def write_autoep_source() -> Path:
    from tests.support.autoep_runs import build_autoep

    return build_autoep(world=4, ep=2, stage=2, global_batch=8).path


@pytest.mark.slow
def test_api_overwrite_replaces_only_what_ucp_wrote(universal: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputExistsError, match="ucp did not write"):
        ucp.write_native(universal, out, dp=2, overwrite=True)
    assert (out / "thesis.tex").read_text() == "years of work"
    ucp.write_native(universal, out, dp=2, overwrite=OutputPolicy(overwrite=True, foreign=True))
    assert owner_kind(out) == "output" and not (out / "thesis.tex").exists()
    ucp.write_native(universal, out, dp=1, overwrite=True)  # now it is ucp's own: True suffices
    assert (out / "latest").is_file()
    with pytest.raises(OutputExistsError, match="already exists"):
        ucp.write_native(universal, out, dp=1)
