"""Outputs are byte-identical to what ucp wrote before the package was reshaped.

``tests/data/golden`` holds small real DeepSpeed checkpoints (written by the harness) and
``expected.json``: for every file each case writes, its sha256 and, for torch files and the
manifest, a digest of what it holds once loaded. Per-parameter records, the safetensors index and
``latest`` must match byte for byte; safetensors files hold the same header (the library writes its
metadata in hash order) and the same data bytes. The files that moved from ``torch.save`` to ucp's one torch-zip
writer (rank files, ``state.pt`` and DeepSpeed's compatibility files) must hold the same content:
every key, every tensor's dtype, shape and bytes, every DeepSpeed object's fields, in order; and
``ucp.json`` the same manifest apart from ``state.pt``'s size and checksum.

Regenerate (only when an output change is intended, and say so in the commit):
``python -m tests.test_golden --write``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.digest import tree

DATA = Path(__file__).resolve().parent / "data" / "golden"
EXPECTED = DATA / "expected.json"
#: Files written byte for byte by the same code before and after (the rest: same content).
_BYTE_EXACT = re.compile(r"(^zero/[^/]+/[^/]+\.pt$|safetensors\.index\.json$|(^|/)latest(_universal)?$)")


def _cases() -> dict[str, Callable[[Path, Path], None]]:
    """case name -> write(work, out): each writes one output folder through the public API."""
    import ucp
    from ucp.targets.export import export

    def universal(name: str) -> Callable[[Path, Path], None]:
        return lambda work, out: ucp.to_universal(DATA / name, out)

    def restore(name: str, **options: Any) -> Callable[[Path, Path], None]:
        def run(work: Path, out: Path) -> None:
            uni = work / f"{name}-u"
            if not uni.exists():
                ucp.to_universal(DATA / name, uni)
            ucp.write_native(uni, out, **options)

        return run

    def direct(name: str, **options: Any) -> Callable[[Path, Path], None]:
        return lambda work, out: ucp.write_native(DATA / name, out, **options)

    def exported(name: str, **options: Any) -> Callable[[Path, Path], None]:
        return lambda work, out: export(DATA / name, out, **options) and None

    return {
        "z3-universal": universal("z3-bf16-dp2"),
        "z2-universal": universal("z2-bf16-dp3"),
        "z1-universal": universal("z1-fp32-dp2"),
        "tp-universal": universal("tp2-z2-fp32-dp1"),
        "z3-to-z3-dp3": restore("z3-bf16-dp2", dp=3, stage=3),
        "z3-to-z2-dp2-fused": restore("z3-bf16-dp2", dp=2, stage=2, optimizer="ds-fused-adam"),
        "z3-to-z1-dp1-fp32-reset": restore("z3-bf16-dp2", dp=1, stage=1, dtype="fp32", step="reset"),
        "z2-to-z3-dp4-sub": restore("z2-bf16-dp3", dp=4, stage=3, sub_group_size=50),
        "z1-to-z2-dp3": restore("z1-fp32-dp2", dp=3, stage=2),
        "tp-to-tp2-z1-dp2": restore("tp2-z2-fp32-dp1", dp=2, stage=1, tp=2),
        "tp-to-tp1-z3-dp2": restore("tp2-z2-fp32-dp1", dp=2, stage=3),
        "z2-direct-z3-dp2": direct("z2-bf16-dp3", dp=2, stage=3, step=7),
        "z3-export": exported("z3-bf16-dp2"),
        "z2-export-bf16-sharded": exported("z2-bf16-dp3", dtype="bf16", max_shard_size=2000),
    }


def _write(work: Path) -> dict[str, dict[str, dict[str, Any]]]:
    result = {}
    for name, run in _cases().items():
        out = work / name
        run(work, out)
        result[name] = tree(out)
    return result


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, Any]]]:
    return _write(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("case", sorted(json.loads(EXPECTED.read_text())) if EXPECTED.exists() else [])
def test_output_is_byte_identical_to_the_recorded_one(case: str, written: dict[str, Any]) -> None:
    expected = json.loads(EXPECTED.read_text())[case]
    got = written[case]
    assert sorted(got) == sorted(expected), case
    for rel, want in expected.items():
        have = got[rel]
        assert have.get("content") == want.get("content"), (case, rel, "loaded content differs")
        if _BYTE_EXACT.search(rel):
            assert have["sha256"] == want["sha256"], (case, rel, "bytes differ")


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the current outputs in expected.json")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        first, second = _write(Path(one)), _write(Path(two))

    def stable(result: dict[str, Any]) -> dict[str, Any]:
        return {c: {r: e.get("content", e["sha256"]) for r, e in files.items()} for c, files in result.items()}

    if stable(first) != stable(second):
        sys.exit("two runs wrote different outputs: nothing to record")
    if args.write:
        EXPECTED.write_text(json.dumps(first, indent=1, sort_keys=True) + "\n")
    print(json.dumps({c: len(f) for c, f in first.items()}))


if __name__ == "__main__":
    _main()
