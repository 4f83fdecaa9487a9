"""Fuzzing real shard files: every damaged checkpoint ends in a result or a clean UcpError.

Two fuzzers, both seeded from real DeepSpeed checkpoints (a ZeRO-3 and a ZeRO-1 one from conftest):

* bytes: flips, truncations and zeroed ranges aimed at the zip headers, the central directory,
  the pickle (with its zip CRC left stale, or patched so the damage reaches the unpickler) and
  the tensor bytes;
* structure: one value deep in a rank file's object tree swapped for something of the wrong
  type, size or sign, re-saved with ucp's own writer (tests.support.files.resave) as a hand-made hostile file would be.

Never another exception type, never a multi-line message, never a hang (a SIGALRM watchdog turns
one into a failure). When the conversion succeeds, its output must read back with checksums, equal
bit for bit what the damaged source holds (read through ucp's own source reader), and:

* bytes: equal the conversion of what torch.load reads from the same damaged bytes, saved back
  cleanly by torch.save; where torch.load refuses the bytes, equal the pristine conversion (itself
  checked against the live engine's record); a pickle whose zip CRC no longer matches is never accepted;
* structure: keep every parameter's name, shape, step and tensor files bit-identical to the
  pristine conversion when the changed slot held no tensor and received none.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import math
import os
import shutil
import signal
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.checks import assert_reader_matches_record
from tests.support.files import resave
from tests.support.fixtures import Built, build
from ucp.errors import CorruptFileError, UcpError
from ucp.io import standins, torchfile
from ucp.ops.convert import to_universal
from ucp.sources import open_reader
from ucp.universal.reader import UniversalReader

# CI runs 60 derandomized examples per fuzzer; by hand, UCP_FUZZ_EXAMPLES=5000 digs deeper and
# UCP_FUZZ_RANDOM=1 draws fresh cases on every run.
FUZZ = settings(
    max_examples=int(os.environ.get("UCP_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize=not os.environ.get("UCP_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
WATCHDOG_S = 120  # far beyond a healthy conversion of this checkpoint, even on a loaded machine


class Hang(Exception):
    """Raised by the watchdog: a conversion of a damaged file did not finish."""


@contextmanager
def watchdog(seconds: int) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"conversion still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Layout:
    """Where the parts of one torch zip file lie, as byte ranges [start, end)."""

    size: int
    local_headers: list[tuple[int, int]]
    central: tuple[int, int]
    pickle: tuple[int, int]
    pickle_header: int
    tensors: list[tuple[int, int]]


def layout_of(data: bytes, path: Path) -> Layout:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    headers, tensors, pickle_span, pickle_header = [], [], (0, 0), 0
    for info in infos:
        head = info.header_offset
        name_len, extra_len = struct.unpack("<HH", data[head + 26 : head + 30])
        start = head + 30 + name_len + extra_len
        headers.append((head, start))
        if info.filename.endswith("/data.pkl"):
            pickle_span, pickle_header = (start, start + info.file_size), head
        elif "/data/" in info.filename and info.file_size:
            tensors.append((start, start + info.file_size))
    end_of_members = max(span[1] for span in [pickle_span, *tensors])
    central_start = data.find(b"PK\x01\x02", end_of_members)
    assert central_start > 0, f"{path}: no central directory after the members"
    return Layout(len(data), headers, (central_start, len(data)), pickle_span, pickle_header, tensors)


def patch_pickle_crc(buf: bytearray, lay: Layout) -> None:
    """Make the zip CRC of data.pkl match its (damaged) bytes, in the local and central headers."""
    start, end = lay.pickle
    crc = struct.pack("<I", zlib.crc32(bytes(buf[start:end])))
    buf[lay.pickle_header + 14 : lay.pickle_header + 18] = crc
    pos = buf.find(b"PK\x01\x02", lay.central[0])
    while pos >= 0:
        if struct.unpack("<I", bytes(buf[pos + 42 : pos + 46]))[0] == lay.pickle_header:
            buf[pos + 16 : pos + 20] = crc
        pos = buf.find(b"PK\x01\x02", pos + 4)


class Pristine(dict):  # type: ignore[type-arg]
    """The undamaged checkpoint's files; a short repr keeps hypothesis' reports readable."""

    def __repr__(self) -> str:
        return f"Pristine({self['built'].path})"


def _torch_globals(paths: list[Path]) -> list[Any]:
    """The DeepSpeed classes the files name, imported for torch.load(weights_only=True) (not ucp's stand-ins)."""
    names = sorted({n for p in paths for n in torch.serialization.get_unsafe_globals_in_checkpoint(p)})
    return [getattr(importlib.import_module(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]


#: besides conftest's SOURCES, a bf16 stage-0 save of DeepSpeed FusedAdam: its fused FP16_Optimizer's flat groups
#: are cut per parameter by matching the module's weights, the stage-0 reader's most intricate path
_STAGE0_FUSED = dict(dp=2, stage=0, dtype="bf16", optimizer="ds-fused-adam")


@pytest.fixture(scope="module", params=["z3-bf16-dp2-adamw", "z1-fp32-dp2-adamw", "z0-bf16-dp2-fused"])
def pristine(
    request: pytest.FixtureRequest, source: Callable[[str], Built], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A ZeRO-3, a ZeRO-1 and a stage-0 checkpoint, read once per module, with their conversion: the reference
    every fuzzed result is held to, itself equal to the live engine's record."""
    built = build(**_STAGE0_FUSED) if request.param == "z0-bf16-dp2-fused" else source(request.param)
    tag = built.tag_dir
    files = sorted(p.name for p in tag.iterdir() if p.suffix == ".pt")
    data = {name: (tag / name).read_bytes() for name in files}
    out = tmp_path_factory.mktemp("pristine") / "u"
    to_universal(built.path, out, workers=1)
    with UniversalReader(out) as reader:
        assert_reader_matches_record(reader, built.record)
    return Pristine(
        built=built,
        files=files,
        data=data,
        layout={name: layout_of(data[name], tag / name) for name in files},
        manifest=json.loads((out / "ucp.json").read_text()),
        globals=_torch_globals([tag / name for name in files]),
    )


def convert_or_clean_error(ckpt: Path, work: Path, damaged: str) -> dict[str, Any] | None:
    """Convert; return the written manifest of a result that reads back with checksums, or None for a
    one-line UcpError (a CorruptFileError naming the ``damaged`` file); fail on anything else."""
    out = work / "out"
    try:
        with watchdog(WATCHDOG_S):
            to_universal(ckpt, out, workers=1)
    except UcpError as err:
        message = str(err)
        assert message and "\n" not in message, f"not a one-line error: {err!r}"
        if isinstance(err, CorruptFileError):
            assert damaged in message, f"the error does not name the damaged file {damaged}: {message}"
        assert not out.exists()
        return None
    assert_reads_back_as_the_source(ckpt, out)
    return json.loads((out / "ucp.json").read_text())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: Any, want: Any, where: str) -> None:
    """Equal, tensors bit for bit (NaN and -0.0 included), floats with NaN equal to NaN."""
    if torch.is_tensor(want):
        assert torch.is_tensor(got), where
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), where
        assert torch.equal(_bits(got), _bits(want)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for key, value in want.items():
            assert_same(got[key], value, f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, standins.DSObject):
        assert type(got) is type(want), where
        assert_same(got.__dict__, want.__dict__, where)
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def assert_reads_back_as_the_source(ckpt: Path, out: Path) -> None:
    """Every value written equals, bit for bit, what the (damaged) source holds."""
    with open_reader(ckpt) as src, UniversalReader(out) as universal:
        names = [meta.name for meta in src.facts.params]
        assert sorted(e.name for e in universal.entries()) == sorted(names)
        for name in names:
            want, got = src.read(name), universal.read(name)
            for field in dataclasses.fields(want):  # fp32, every optimizer tensor, the step, ...
                assert_same(getattr(got, field.name), getattr(want, field.name), f"{name} {field.name}")
        assert_same(universal.buffers(), src.buffers(), "buffers")
        assert_same(universal.extras(), src.extras(), "extras")


def _copy(pristine: dict[str, Any], work: Path) -> Path:
    ckpt = work / "ckpt"
    shutil.copytree(pristine["built"].path, ckpt)
    return ckpt


REGIONS = ("local_header", "central_directory", "pickle_stale_crc", "pickle_patched_crc", "tensor_bytes", "anywhere")
KINDS = ("flip", "truncate", "zero")


def _span(lay: Layout, region: str, pick: int) -> tuple[int, int]:
    if region == "local_header":
        return lay.local_headers[pick % len(lay.local_headers)]
    if region == "central_directory":
        return lay.central
    if region.startswith("pickle"):
        return lay.pickle
    if region == "tensor_bytes":
        return lay.tensors[pick % len(lay.tensors)]
    return 0, lay.size


@FUZZ
@given(
    file_index=st.integers(0, 11),
    region=st.sampled_from(REGIONS),
    kind=st.sampled_from(KINDS),
    pick=st.integers(0, 1000),
    where=st.floats(0, 1, allow_nan=False),
    length=st.integers(1, 64),
    bit=st.integers(0, 7),
)
@pytest.mark.slow
def test_byte_damage_ends_in_a_result_or_a_clean_error(
    pristine: dict[str, Any], file_index: int, region: str, kind: str, pick: int, where: float, length: int, bit: int
) -> None:
    name = pristine["files"][file_index % len(pristine["files"])]
    lay: Layout = pristine["layout"][name]
    start, end = _span(lay, region, pick)
    pos = min(end - 1, start + int(where * (end - start)))
    buf = bytearray(pristine["data"][name])
    if kind == "flip":
        buf[pos] ^= 1 << bit
    elif kind == "truncate":
        del buf[pos:]
    else:
        buf[pos : pos + length] = bytes(len(buf[pos : pos + length]))
    if region == "pickle_patched_crc" and kind != "truncate":
        patch_pickle_crc(buf, lay)
    original = pristine["data"][name]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = _copy(pristine, work)
        target = ckpt / pristine["built"].tag_dir.name / name
        target.write_bytes(bytes(buf))
        result = convert_or_clean_error(ckpt, work, name)
        if result is None:
            return
        start, end = lay.pickle
        if bytes(buf[start:end]) != original[start:end] and not (region == "pickle_patched_crc" and kind != "truncate"):
            pytest.fail(f"{name}: the pickle changed under a stale zip CRC and ucp accepted it")
        # what torch.load reads from the same bytes; where torch refuses them, only damage that carries
        # no value (no-op damage included) may be accepted, so the output must be the pristine one
        expected = as_torch_reads_it(pristine, name, bytes(buf), work) if bytes(buf) != original else None
        if expected is None:
            expected = pristine["manifest"]
        assert result == expected, f"{name}: the output is not what the damaged source holds"


def as_torch_reads_it(pristine: dict[str, Any], name: str, damaged: bytes, work: Path) -> dict[str, Any] | None:
    """The manifest ucp writes for the checkpoint whose file ``name`` holds what torch.load reads from
    ``damaged``, saved back cleanly by torch.save (a reader ucp shares no byte-level code with); None
    when torch.load refuses ``damaged``."""
    try:
        with torch.serialization.safe_globals(pristine["globals"]):
            obj = torch.load(io.BytesIO(damaged), weights_only=True)
    except Exception:  # noqa: BLE001 - torch raises many types for a damaged file
        return None
    ref = work / "torch"
    shutil.copytree(pristine["built"].path, ref)
    target = ref / pristine["built"].tag_dir.name / name
    target.unlink()
    torch.save(obj, target)
    to_universal(ref, work / "torch-out", workers=1)
    return json.loads((work / "torch-out" / "ucp.json").read_text())


# -- structure-aware fuzzing ------------------------------------------------------------------
def _slots(obj: Any, path: tuple[Any, ...] = (), depth: int = 0) -> Iterator[tuple[Any, ...]]:
    """Every (container path) in a loaded rank file that can be replaced or deleted."""
    if depth > 6:
        return
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, list):
        items = list(enumerate(obj))
    elif isinstance(obj, standins.DSObject):
        items = [(("attr", k), v) for k, v in obj.__dict__.items()]
    else:
        return
    for key, value in items:
        yield path + (key,)
        yield from _slots(value, path + (key,), depth + 1)


def _parent(obj: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    for key in path[:-1]:
        obj = getattr(obj, key[1]) if isinstance(key, tuple) and key and key[0] == "attr" else obj[key]
    return obj, path[-1]


def _get(container: Any, key: Any) -> Any:
    return getattr(container, key[1]) if isinstance(key, tuple) and key and key[0] == "attr" else container[key]


def _set(container: Any, key: Any, value: Any) -> None:
    if isinstance(key, tuple) and key and key[0] == "attr":
        setattr(container, key[1], value)
    else:
        container[key] = value


def _delete(container: Any, key: Any) -> None:
    if isinstance(key, tuple) and key and key[0] == "attr":
        delattr(container, key[1])
    else:
        del container[key]


def _replacement(old: Any, how: str) -> Any:
    if how == "none":
        return None
    if how == "string":
        return "garbage"
    if how == "negative":
        return -7
    if how == "huge":
        return 2**62
    if how == "float":
        return float("nan")
    if how == "empty_list":
        return []
    if how == "empty_dict":
        return {}
    if how == "int_tensor":
        return torch.zeros(3, dtype=torch.int64)
    if how == "scalar_tensor":
        return torch.tensor(1.5)
    if how == "shorter" and torch.is_tensor(old) and old.numel() > 1:
        return old.reshape(-1)[:-1].clone()
    if how == "longer" and torch.is_tensor(old):
        return torch.cat([old.reshape(-1), old.reshape(-1)[:1]]) if old.numel() else torch.zeros(1)
    if how == "reshaped" and torch.is_tensor(old) and old.numel() > 1:
        return old.reshape(1, -1).clone()
    if how == "bigger_shape" and isinstance(old, (tuple, list, torch.Size)) and all(type(d) is int for d in old):
        return torch.Size([int(d) * 1000 + 1 for d in old]) if old else torch.Size([5])
    if how == "negative_shape" and isinstance(old, (tuple, list, torch.Size)):
        return [-1 for _ in old] or [-1]
    if how == "name_with_slash" and isinstance(old, dict) and old:
        first = next(iter(old))
        return {("../" + first if isinstance(first, str) else first): v for k, v in old.items()}
    return None


HOWS = (
    "delete",
    "none",
    "string",
    "negative",
    "huge",
    "float",
    "empty_list",
    "empty_dict",
    "int_tensor",
    "scalar_tensor",
    "shorter",
    "longer",
    "reshaped",
    "bigger_shape",
    "negative_shape",
    "name_with_slash",
)


@pytest.mark.slow
@FUZZ
@given(file_index=st.integers(0, 11), slot=st.integers(0, 10**6), how=st.sampled_from(HOWS))
def test_structural_damage_ends_in_a_result_or_a_clean_error(
    pristine: dict[str, Any], file_index: int, slot: int, how: str
) -> None:
    name = pristine["files"][file_index % len(pristine["files"])]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = _copy(pristine, work)
        target = ckpt / pristine["built"].tag_dir.name / name
        obj = torchfile.load(target)
        slots = list(_slots(obj))
        container, key = _parent(obj, slots[slot % len(slots)])
        old = _get(container, key)
        if how == "delete":
            _delete(container, key)
            touched = _holds_tensor(old)
        else:
            new = _replacement(old, how)
            _set(container, key, new)
            touched = _holds_tensor(old) or _holds_tensor(new)
        resave(obj, target)
        result = convert_or_clean_error(ckpt, work, name)
        if result is not None and not touched:
            # No tensor was changed, so no parameter may change or go missing: same names, shapes, steps, file
            # checksums. A name taken from buffer_names or shared_params makes that module entry read as one
            # more frozen parameter (nothing else in a stage-1 file tells them apart): extra, never lost.
            got = {p["name"]: p for p in result["params"]}
            for want in pristine["manifest"]["params"]:
                assert got.pop(want["name"], None) == want, f"{name}: a change to no tensor moved {want['name']}"
            assert all(p["frozen"] for p in got.values()), f"{name}: new optimized parameters {list(got)}"


def _holds_tensor(obj: Any) -> bool:
    if torch.is_tensor(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(k) or _holds_tensor(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    if isinstance(obj, standins.DSObject):
        return _holds_tensor(obj.__dict__)
    return False
