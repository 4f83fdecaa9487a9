"""Every format of the two registries has a label, a docs section, a real fixture and a round trip.

Sources: a real checkpoint of each format (the suite's cached runs) is claimed by that format alone, converted to a
universal directory, and the universal directory holds it bit for bit. Targets: each is written from a real source
through the registry and read back by the format that claims it, equal to the source (``ucp.diff``). A new format
without a row here fails the coverage tests below.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import ucp
from tests.conftest import TP_SOURCES
from tests.support.fixtures import build
from ucp.model.option_table import OPTIONS
from ucp.ops.verify import verify_universal
from ucp.sources import SOURCE_FORMATS, open_reader
from ucp.targets.format import Request
from ucp.targets.registry import TARGET_FORMATS, choose, write

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _ds_universal(tmp: Path) -> Path:
    from tests.support.ds_convert import ds_to_universal

    built = build(dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", sub_group_size=60)
    out = tmp / f"{built.tag_dir.name}_universal"
    done = ds_to_universal(built.tag_dir, out)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _dcp(tmp: Path) -> Path:
    from tests.test_dcp import FSDP_SOURCE, _cached, run_fsdp

    return _cached("fsdp-source", replace(FSDP_SOURCE, save_dir="yes"), run_fsdp) / "dcp"


def _trainer(tmp: Path) -> Path:
    from tests.support.hf_runs import SAVED_AT, cached_run
    from tests.support.hf_worker import HfSpec

    return cached_run("trainer-z2-save", HfSpec(world=2, stage=2)).out / f"checkpoint-{SAVED_AT}"


def _accelerate(tmp: Path) -> Path:
    from tests.support.hf_runs import ACCELERATE_WORKER, cached_run
    from tests.support.hf_worker import HfSpec

    return cached_run("accel-z2-save", HfSpec(world=2, stage=2), module=ACCELERATE_WORKER).out / "state"


def _pipeline(tmp: Path) -> Path:
    from tests.support.pipeline_runs import build_pipe

    return build_pipe(pp=2, dp=2, stage=1, dtype="fp32").path


def _moe(tmp: Path) -> Path:
    from tests.support.moe_runs import build_moe

    return build_moe(world=4, ep=2, experts=4, stage=2, dtype="fp32").path


def _autoep(tmp: Path) -> Path:
    from tests.support.autoep_runs import build_autoep

    return build_autoep(world=4, ep=2, stage=2, global_batch=8).path


def _trainer_fsdp(tmp: Path) -> Path:
    from tests.support.hf_runs import SAVED_AT, cached_run, fsdp_extra
    from tests.support.hf_worker import HfSpec

    return cached_run("trainer-fsdp2-sharded-save", HfSpec(world=2, extra=fsdp_extra(2))).out / f"checkpoint-{SAVED_AT}"


def _accelerate_fsdp(tmp: Path) -> Path:
    from tests.support.hf_runs import ACCELERATE_WORKER, cached_run, fsdp_extra
    from tests.support.hf_worker import HfSpec

    spec = HfSpec(world=2, extra=fsdp_extra(2))
    return cached_run("accel-fsdp2-sharded-save", spec, module=ACCELERATE_WORKER).out / "state"


def _verl(tmp: Path) -> Path:
    pytest.importorskip("verl")
    from tests.support.verl_runs import cached_verl
    from tests.support.verl_worker import VerlSpec

    return cached_verl("fsdp2-w2-save", VerlSpec(world=2, fsdp=2)).actor


def _megatron(tmp: Path) -> Path:
    if importlib.util.find_spec("megatron") is None:  # not imported here: it widens torch.load's allow-list
        pytest.skip("megatron-core is not installed")
    from tests.support.megatron_runs import cached_run, save_spec

    return cached_run("tp1dp2-dpr", save_spec(1, 1, 2, "dp_reshardable")).out  # type: ignore[return-value]


def _universal(tmp: Path) -> Path:
    ucp.to_universal(_zero3(tmp), tmp / "u")
    return tmp / "u"


def _zero3(tmp: Path) -> Path:
    return build(dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", sub_group_size=60).path


#: source format -> a real checkpoint of it (cached runs, the same specs as the suite's other tests)
SOURCES: dict[str, Callable[[Path], Path]] = {
    "universal": _universal,
    "ds-universal": _ds_universal,
    "dcp": _dcp,
    "hf-trainer": _trainer,
    "hf-accelerate": _accelerate,
    "hf-trainer-fsdp": _trainer_fsdp,
    "hf-accelerate-fsdp": _accelerate_fsdp,
    "megatron": _megatron,
    "verl-fsdp": _verl,
    "deepspeed-zero3": _zero3,
    "deepspeed-zero12": lambda tmp: build(dp=2, stage=1, dtype="fp32", optimizer="torch-adamw").path,
    "deepspeed-zero0": lambda tmp: build(dp=2, stage=0, dtype="bf16", optimizer="torch-adamw").path,
    "deepspeed-tp": lambda tmp: build(**TP_SOURCES["tp2-z2-fp32-dp1"]).path,
    "deepspeed-pipeline": _pipeline,
    "deepspeed-moe": _moe,
    "deepspeed-autoep": _autoep,
}

#: target format -> (its source, the request, the source format that reads the output back)
TARGETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "deepspeed": ("deepspeed-zero3", {"dp": 3}, "deepspeed-zero3"),
    "dcp": ("deepspeed-zero3", {}, "dcp"),
    "hf-folder": ("hf-trainer", {"dp": 3}, "hf-trainer"),
    "hf-fsdp-folder": ("hf-trainer-fsdp", {"dp": 3}, "hf-trainer-fsdp"),
    "megatron": ("megatron", {}, "megatron"),
    "verl-fsdp": ("verl-fsdp", {"dp": 3}, "verl-fsdp"),
    "deepspeed-pipeline": (
        "deepspeed-pipeline",
        {"dp": 1, "pp": 2, "pp_parts": "0,3,6", "pp_tied": ["embed=0,5"]},
        "deepspeed-pipeline",
    ),
    "deepspeed-moe": ("deepspeed-moe", {"dp": 4}, "deepspeed-moe"),
    "deepspeed-autoep": ("deepspeed-autoep", {"dp": 4}, "deepspeed-autoep"),
}
_ASKED = {"dcp": "dcp", "verl-fsdp": "verl-fsdp", "megatron": "megatron"}


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        anchor = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        seen[anchor] = seen.get(anchor, -1) + 1
        out.add(anchor if seen[anchor] == 0 else f"{anchor}-{seen[anchor]}")
    return out


@pytest.mark.parametrize("fmt", [*SOURCE_FORMATS, *TARGET_FORMATS], ids=lambda f: f.name)
def test_every_format_has_a_label_and_a_docs_section(fmt: Any) -> None:
    assert fmt.label and fmt.name
    page, _, anchor = fmt.docs.partition("#")
    assert anchor in _anchors(DOCS / page), f"{fmt.name}: docs/{fmt.docs} is no heading"


def test_every_format_has_a_row_here_and_every_option_names_registered_targets() -> None:
    assert {f.name for f in SOURCE_FORMATS} == set(SOURCES)
    assert {t.name for t in TARGET_FORMATS} == set(TARGETS)
    assert len({f.label for f in SOURCE_FORMATS}) == len(SOURCE_FORMATS)
    for option in OPTIONS:
        assert option.targets <= set(TARGETS), option.name


@pytest.fixture(scope="module")
def fixture(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = SOURCES[name](tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_each_source_format_claims_its_own_and_reaches_the_universal_directory_bit_for_bit(
    name: str, fixture: Callable[[str], Path], tmp_path: Path
) -> None:
    path = fixture(name)
    with open_reader(path) as reader:
        assert reader.format == name
        assert reader.inputs == (path,)
    ucp.to_universal(path, tmp_path / "u")
    result = verify_universal(path, tmp_path / "u")
    assert result.ok, result.message


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TARGETS))
def test_each_target_format_writes_what_its_reader_reads_back_equal(
    name: str, fixture: Callable[[str], Path], tmp_path: Path
) -> None:
    source, values, back = TARGETS[name]
    src = fixture(source)
    if name in (
        "hf-folder",
        "hf-fsdp-folder",
    ):  # a Trainer folder's files are copied: the source lies apart from the output
        src = Path(shutil.copytree(src, tmp_path / "src" / src.name))
    request = Request(values)
    out = tmp_path / "out"
    with open_reader(src) as reader:
        assert choose(reader, request, _ASKED.get(name)).name == name
        written = write(reader, out, request, _ASKED.get(name))
    assert written.summary.startswith("wrote ") and written.fields["format"] in (name, "trainer", "deepspeed")
    with open_reader(out) as reader:
        assert reader.format == back
    report = ucp.diff(src, out)
    assert report.equal, "\n".join(report.lines())
