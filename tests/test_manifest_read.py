"""ucp.json read back field by field, its ``params`` entry by entry (ucp.universal.manifest_file, param_table).

The reader never holds a 10^5-parameter manifest as parsed JSON: it parses the top-level fields with json's scanner
and hands each parameter's entry to the table as it is parsed. These tests hold that parse to ``json.loads`` on a
real universal directory (any whitespace, the field order of any writer) and to one line for each kind of damage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ucp.errors import CorruptFileError, InputError
from ucp.universal.manifest import MANIFEST
from ucp.universal.reader import open_universal


def _copy(universals, tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "u"
    shutil.copytree(universals("z3-fp32-dp3-adamw"), root)
    return root, json.loads((root / MANIFEST).read_text())


def _facts(root: Path) -> tuple:
    reader = open_universal(root)
    return reader.facts, [e.to_json() for e in reader.entries()], reader.manifest


@pytest.mark.parametrize("layout", ["indented", "params first", "no spaces", "reversed entries"])
def test_any_layout_of_the_same_json_reads_the_same(universals, tmp_path: Path, layout: str) -> None:
    root, raw = _copy(universals, tmp_path)
    expected = _facts(root)
    if layout == "indented":
        text = json.dumps(raw, indent=4)
    elif layout == "params first":
        text = json.dumps({"params": raw["params"], **{k: v for k, v in raw.items() if k != "params"}})
    elif layout == "no spaces":
        text = json.dumps(raw, separators=(",", ":"))
    else:
        text = " \n" + json.dumps({**raw, "params": raw["params"][::-1]}) + "\n\t "
    (root / MANIFEST).write_text(text)
    facts, entries, manifest = _facts(root)
    if layout == "reversed entries":
        assert entries == expected[1][::-1] and manifest == expected[2]
        assert sorted(facts.params, key=lambda m: m.name) == sorted(expected[0].params, key=lambda m: m.name)
    else:
        assert (facts, entries, manifest) == expected


def test_the_reader_keeps_no_parsed_entry_and_builds_the_same_entries(universals, tmp_path: Path) -> None:
    root, raw = _copy(universals, tmp_path)
    reader = open_universal(root)
    assert [e.to_json() for e in reader.entries()] == raw["params"]
    assert "params" not in reader.manifest
    # shared across parameters: one tuple per distinct set of files, the facts' shapes are the table's
    table = reader._table
    assert len({id(table.files(i)) for i in range(len(table))}) == len({table.files(i) for i in range(len(table))})
    assert all(table.shape(i) is reader.facts.params[i].shape for i in range(len(table)))


_PARAMS = '\n "params": [\n'  # the top-level field as ucp writes it (the groups' lists are "params" too)


def _in_params(text: str, old: str, new: str) -> str:
    """``text`` with the first ``old`` inside the top-level params list put before itself as ``new``."""
    head, params = text.split(_PARAMS, 1)
    return head + _PARAMS + params.replace(old, new, 1)


@pytest.mark.parametrize(
    ("damage", "error", "needle"),
    [
        (lambda t: t.replace('"format"', '"format": 1, "format"', 1), CorruptFileError, "twice"),
        (lambda t: t + "x", CorruptFileError, "not valid JSON"),
        (lambda t: t.rstrip()[:-1], CorruptFileError, "not valid JSON"),
        (lambda t: "[" + t + "]", InputError, "not a ucp manifest"),
        (lambda t: t.replace(_PARAMS, _PARAMS + "[" * 40 + "]" * 40 + ", "), CorruptFileError, "nested"),
        (lambda t: t.replace(_PARAMS, _PARAMS + "7, "), CorruptFileError, "params\\[0\\]"),
        (lambda t: _in_params(t, '"step": ', f'"step": {1 << 64}'), CorruptFileError, "past any real"),
        (lambda t: _in_params(t, '{"bytes": ', f'{{"bytes": {1 << 70}'), CorruptFileError, "past any real"),
        (lambda t: t.replace(_PARAMS, '\n "params": {"a": [').replace("\n ]", "\n ]}"), CorruptFileError, "params is"),
    ],
    ids=[
        "field twice",
        "trailing bytes",
        "cut short",
        "not an object",
        "nested",
        "entry not an object",
        "step past 64 bits",
        "bytes past 64 bits",
        "not a list",
    ],
)
def test_a_damaged_manifest_is_one_error(universals, tmp_path: Path, damage, error: type, needle: str) -> None:
    root, _ = _copy(universals, tmp_path)
    text = (root / MANIFEST).read_text()
    damaged = damage(text)
    assert damaged != text
    (root / MANIFEST).write_text(damaged)
    with pytest.raises(error, match=needle):
        open_universal(root)
