"""ucp.io.torchfile: the only door by which checkpoint bytes enter ucp.

The promises kept here: every load is weights_only with ucp's own allow-list, a hostile global is
refused by name before anything runs, damaged files end in one-line CorruptFileErrors, and a
source file is never written through.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from tests.support.files import resave
from tests.support.hostile import CALLS, Hostile, record_call
from ucp.errors import CorruptFileError, UnsafeFileError
from ucp.io import standins, torchfile


class SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return os.system, (f"touch {self.marker}",)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


@pytest.fixture(autouse=True)
def _no_calls() -> None:
    CALLS.clear()


def test_round_trip_keeps_deepspeed_standins(tmp_path: Path) -> None:
    obj = {
        "zero_stage": standins.ZeroStageEnum(3),
        "loss_scaler": standins.LossScaler(cur_scale=2.0, dynamic=False),
        "dyn": standins.DynamicLossScaler(cur_scale=4.0, cur_iter=7),
        "args": standins.Namespace(lr=0.1),
        "tensors": [torch.arange(6, dtype=torch.bfloat16).view(2, 3), torch.ones(3)],
        "nested": {"t": (torch.zeros(2), 1, "x")},
    }
    resave(obj, tmp_path / "f.pt")
    back = torchfile.load(tmp_path / "f.pt")
    assert back["zero_stage"] == 3 and isinstance(back["zero_stage"], standins.ZeroStageEnum)
    assert back["loss_scaler"] == obj["loss_scaler"]
    assert back["dyn"] == obj["dyn"] and back["args"] == obj["args"]
    assert torch.equal(back["tensors"][0], obj["tensors"][0])
    assert torch.equal(back["nested"]["t"][0], torch.zeros(2))


def test_refuses_reduce_to_a_function_off_the_allow_list_without_running_it(tmp_path: Path) -> None:
    torch.save({"state": Hostile()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeFileError) as info:
        torchfile.load(tmp_path / "evil.pt")
    message = _one_line(info.value)
    assert "record_call" in message and "allow-list" in message
    assert CALLS == []


def test_refuses_os_system_reduce_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": SystemCall(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeFileError) as info:
        torchfile.TorchFile(tmp_path / "evil.pt")
    message = _one_line(info.value)
    # os.system pickles as posix.system (its __module__ on Linux); the refusal names it and the file
    expected = f"{tmp_path / 'evil.pt'} refers to posix.system, which is not on ucp's allow-list"
    assert message.startswith(expected), message
    assert not marker.exists()


def test_process_wide_safe_globals_do_not_widen_the_allow_list(tmp_path: Path) -> None:
    torch.save([Hostile()], tmp_path / "evil.pt")
    with torch.serialization.safe_globals([record_call]):
        with pytest.raises(UnsafeFileError, match="record_call"):
            torchfile.load(tmp_path / "evil.pt")
    assert CALLS == []
    assert f"{record_call.__module__}.record_call" not in torchfile.allowed_globals()


def test_refuses_builtins_eval_in_a_legacy_format_file(tmp_path: Path) -> None:
    class Eval:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return eval, ("__import__('os').system('true')",)

    torch.save({"x": Eval()}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeFileError, match="eval"):
        torchfile.load(tmp_path / "legacy.pt")


def test_reads_a_legacy_format_file(tmp_path: Path) -> None:
    torch.save({"a": torch.arange(4.0), "s": 2}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    back = torchfile.load(tmp_path / "legacy.pt")
    assert torch.equal(back["a"], torch.arange(4.0)) and back["s"] == 2


def test_refuses_stack_global_opcodes(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(1)}, tmp_path / "p4.pt", pickle_protocol=4)
    with pytest.raises(UnsafeFileError) as info:
        torchfile.load(tmp_path / "p4.pt")
    message = _one_line(info.value)
    assert message.startswith(f"{tmp_path / 'p4.pt'} builds objects with the STACK_GLOBAL opcode"), message
    assert "refused without running it" in message


@pytest.mark.parametrize("damage", ["empty", "garbage", "half", "no_tail", "head_only", "pickle_bytes"])
def test_damaged_files_end_in_one_line_corrupt_file_errors(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "f.pt"
    torch.save({"w": torch.arange(1000.0), "n": 3}, path)
    data = path.read_bytes()
    if damage == "empty":
        data = b""
    elif damage == "garbage":
        data = os.urandom(4096)
    elif damage == "half":
        data = data[: len(data) // 2]
    elif damage == "no_tail":
        data = data[:-30]
    elif damage == "head_only":
        data = data[:40]
    elif damage == "pickle_bytes":
        with zipfile.ZipFile(path) as zf:
            info = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
        head = info.header_offset
        name_len, extra_len = struct.unpack("<HH", data[head + 26 : head + 30])
        start = head + 30 + name_len + extra_len
        buf = bytearray(data)
        buf[start + 5] ^= 0x41
        data = bytes(buf)
    path.write_bytes(data)
    with pytest.raises(CorruptFileError) as info:
        torchfile.load(path)
    assert str(path.name) in _one_line(info.value)


def test_missing_file_and_folder_are_corrupt_file_errors(tmp_path: Path) -> None:
    with pytest.raises(CorruptFileError, match="does not exist"):
        torchfile.load(tmp_path / "nope.pt")
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(CorruptFileError, match="not a regular file"):
        torchfile.load(tmp_path / "dir.pt")


def test_file_saved_without_crc32_still_loads(tmp_path: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(5.0)}, tmp_path / "f.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.equal(torchfile.load(tmp_path / "f.pt")["w"], torch.arange(5.0))


def test_refuses_a_tensor_claiming_far_more_bytes_than_its_storage(tmp_path: Path) -> None:
    torch.save({"big": torch.zeros(1).expand(1 << 22)}, tmp_path / "amp.pt")
    with pytest.raises(CorruptFileError, match="claims"):
        torchfile.load(tmp_path / "amp.pt")
    torch.save({"small": torch.zeros(1).expand(10)}, tmp_path / "ok.pt")
    assert torchfile.load(tmp_path / "ok.pt")["small"].shape == (10,)


def _raw_torch_zip(path: Path, pickle_bytes: bytes) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")


def test_deeply_nested_pickle_is_a_clean_error(tmp_path: Path) -> None:
    depth = 200_000
    body = pickle.PROTO + b"\x02" + pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1) + pickle.STOP
    _raw_torch_zip(tmp_path / "deep.pt", body)
    with pytest.raises(CorruptFileError, match="nests"):
        torchfile.load(tmp_path / "deep.pt")


def test_bad_persistent_ids_are_clean_errors(tmp_path: Path) -> None:
    buf = io.BytesIO()

    class _P(pickle.Pickler):
        def persistent_id(self, obj):  # type: ignore[no-untyped-def]
            return ("storage", "not-a-type", "0", "cpu", -5) if obj == "ref" else None

    _P(buf, protocol=2).dump(["ref"])
    _raw_torch_zip(tmp_path / "pid.pt", buf.getvalue())
    with pytest.raises(CorruptFileError) as info:
        torchfile.load(tmp_path / "pid.pt")
    message = _one_line(info.value)
    assert message.startswith(f"{tmp_path / 'pid.pt'}: malformed storage reference ('storage', 'not-a-type'"), message


def test_source_file_is_never_written_through_its_mapping(tmp_path: Path) -> None:
    path = tmp_path / "f.pt"
    torch.save({"w": torch.arange(100.0)}, path)
    os.chmod(path, 0o444)
    before, mtime = _digest(path), path.stat().st_mtime_ns
    with torchfile.TorchFile(path) as tf:
        tf.obj["w"].add_(1)  # a private copy-on-write page; the file must not see it
        assert torch.equal(tf.obj["w"], torch.arange(100.0) + 1)  # the write landed in the private copy
        tf.release(tf.obj["w"])  # drops the private pages: the next read comes from the file again
        assert torch.equal(tf.obj["w"], torch.arange(100.0))
    assert _digest(path) == before and path.stat().st_mtime_ns == mtime


def test_tensors_stay_valid_after_the_file_is_closed(tmp_path: Path) -> None:
    """close() must not unmap memory that live tensors still view (it used to: a segfault)."""
    resave({"w": torch.arange(4096.0), "scaler": standins.LossScaler(cur_scale=torch.tensor(8.0))}, tmp_path / "f.pt")
    with torchfile.TorchFile(tmp_path / "f.pt") as tf:
        kept = tf.obj["w"][10:20]
        scale = tf.obj["scaler"].cur_scale
    torch.save({"other": torch.zeros(1 << 20)}, tmp_path / "g.pt")  # churn the address space
    torchfile.load(tmp_path / "g.pt")
    assert torch.equal(kept, torch.arange(10.0, 20.0)) and float(scale) == 8.0
    loaded = torchfile.load(tmp_path / "f.pt")
    assert float(loaded["scaler"].cur_scale) == 8.0


def test_a_zero_dim_counter_is_copied_out_of_the_mapping(tmp_path: Path) -> None:
    """A step counter read after the file's pages were dropped must not map a folio of the file back in (a save of
    4096 ranks kept 500 MiB resident for them): 0-dim storages are copies, the rest stay views on the file."""
    path = tmp_path / "optim.pt"
    torch.save({"step": torch.tensor(7, dtype=torch.int64), "flat": torch.arange(1000.0), "few": torch.ones(3)}, path)
    with torchfile.TorchFile(path) as tf:
        assert tf.obj["step"].item() == 7 and tf.span(tf.obj["step"]) is None
        assert tf.span(tf.obj["flat"]) is not None and tf.span(tf.obj["few"]) is not None
        assert torch.equal(tf.obj["flat"], torch.arange(1000.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_placeholder_is_written_byte_for_byte_as_an_empty_tensor(tmp_path: Path, dtype: torch.dtype) -> None:
    """ZeRO-3 model-states files hold one empty tensor per parameter; ucp holds them as Placeholders (10^5 tensor
    objects for a MoE would cost 50 MB) and must write what torch.empty(0) writes, a storage record each."""
    from ucp.io.torchzip import write_torch_file
    from ucp.model.pieces import Placeholder

    (tmp_path / "held").mkdir()
    (tmp_path / "light").mkdir()
    held = tmp_path / "held" / "states.pt"  # one name: the zip's folder is the file's stem
    light = tmp_path / "light" / "states.pt"
    write_torch_file({"module": {"a": torch.empty(0, dtype=dtype), "b": torch.empty(0, dtype=dtype)}}, held)
    write_torch_file({"module": {"a": Placeholder(dtype), "b": Placeholder(dtype)}}, light)
    assert light.read_bytes() == held.read_bytes()
    back = torch.load(light, weights_only=True)["module"]
    assert [(t.dtype, tuple(t.shape)) for t in back.values()] == [(dtype, (0,))] * 2


def test_an_unshared_dict_is_written_without_the_memo_and_loads_as_the_ordered_dict_it_holds(tmp_path: Path) -> None:
    """A ZeRO-3 model-states file holds an empty tensor and a shape per parameter; the pickler's memo kept every
    object it wrote alive to the end (about 700 bytes an entry). An UnsharedDict is written without it: the memo
    stops growing after its first two entries, and the file loads as the same OrderedDict, entry for entry, with a
    storage of its own per tensor, in either pickler."""
    import pickletools
    from collections import OrderedDict

    from ucp.io.torchpickle import UnsharedDict, _Pickler, pickle_object
    from ucp.io.torchzip import write_torch_file
    from ucp.model.pieces import Placeholder

    def build(kind: type, n: int = 3000) -> dict:
        module = kind((f"p{i}", Placeholder(torch.bfloat16)) for i in range(n))
        module["buffer"] = torch.arange(5.0)
        return {"module": module, "shapes": [kind((f"p{i}", torch.Size((i, 3))) for i in range(n - 500))], "step": 4}

    def puts(data: bytes) -> int:
        return sum(op.name.endswith("PUT") for op, _, _ in pickletools.genops(data))

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_torch_file(build(OrderedDict), tmp_path / "a" / "states.pt")
    write_torch_file(build(UnsharedDict), tmp_path / "b" / "states.pt")
    memo, unshared = (torch.load(tmp_path / d / "states.pt", weights_only=True) for d in ("a", "b"))
    assert type(unshared["module"]) is OrderedDict and list(unshared["module"]) == list(memo["module"])
    for name, tensor in memo["module"].items():
        got = unshared["module"][name]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape) and torch.equal(got, tensor)
    assert unshared["shapes"] == memo["shapes"] and unshared["step"] == 4
    assert len({t.untyped_storage()._cdata for t in unshared["module"].values()}) == 3001

    assert puts(pickle_object(build(OrderedDict))[0]) > 5000
    few = puts(pickle_object(build(UnsharedDict, 1500))[0])  # the first two entries of each, and the outer object
    assert few < 60 and puts(pickle_object(build(UnsharedDict, 3500))[0]) == few
    buffer = io.BytesIO()
    slow = _Pickler(buffer)  # the pure-Python pickler, taken when a stand-in's name is ambiguous, keeps it too
    slow.dump(build(UnsharedDict))
    assert puts(buffer.getvalue()) < 60
    tied = torch.ones(2)
    data, records = pickle_object({"m": UnsharedDict(a=torch.zeros(1), b=torch.zeros(1), c=tied, d=tied)})
    assert len(records) == 4  # an object met twice inside may be written twice


def _central_entries(data: bytes) -> tuple[int, int, list[bytes]]:
    """(start, end, entries) of a plain zip's central directory (as torch writes a small file)."""
    end_record = data.rindex(b"PK\x05\x06")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<IHHHHIIH", data, end_record)
    entries, pos = [], cd_offset
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        size = 46 + name_len + extra_len + comment_len
        entries.append(data[pos : pos + size])
        pos += size
    return cd_offset, cd_offset + cd_size, entries


def _assemble(data: bytes, entries: list[bytes], comment: bytes = b"") -> bytes:
    """``data`` with its central directory replaced by ``entries`` (and a comment after the end record)."""
    start, _, _ = _central_entries(data)
    directory = b"".join(entries)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), start, len(comment))
    return data[:start] + directory + end + comment


def test_the_zip_directory_is_read_as_zipfile_reads_it_zip64_included(tmp_path: Path) -> None:
    """ucp reads a torch file's zip directory itself (zipfile held a ZipInfo per member: 50 MB while a MoE's
    model-states file of 10^5 members opened). Every member must land where zipfile puts it: for torch's own
    zip64 end records (more than 65535 members), for zip64 sizes in the central entries, and with a comment after
    the end record; a member given twice is refused."""
    import mmap

    from ucp.io.zip_records import zip_records

    def agrees(path: Path) -> None:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            records, pickle_name = zip_records(path, mm, path.stat().st_size)
            with zipfile.ZipFile(path) as archive:
                infos = archive.infolist()
                for info in infos:
                    start, length = records[info.filename]
                    assert length == info.file_size and mm[start : start + length] == archive.read(info)
            assert len(records) == len(infos) and pickle_name.endswith("/data.pkl")

    many = tmp_path / "many.pt"
    torch.save({"module": {f"p{i}": torch.empty(0) for i in range(70000)}, "w": torch.arange(6.0)}, many)
    assert b"PK\x06\x06" in many.read_bytes()[-200:]  # torch wrote zip64 end records
    agrees(many)
    assert torch.equal(torchfile.load(many)["w"], torch.arange(6.0))

    small = tmp_path / "small.pt"
    torch.save({"w": torch.arange(1000.0), "n": 3}, small)
    data = small.read_bytes()
    _, _, entries = _central_entries(data)

    def widened_entry(entry: bytes, values: int = 2) -> bytes:
        """The entry with its sizes moved into a zip64 extra field (as a writer does past 4 GB), of ``values``."""
        name_len = struct.unpack_from("<H", entry, 28)[0]
        size = struct.unpack_from("<I", entry, 24)[0]
        extra = struct.pack(f"<HH{values}Q", 0x0001, 8 * values, *[size] * values)
        head = bytearray(entry[:46])
        struct.pack_into("<IIHH", head, 20, 0xFFFFFFFF, 0xFFFFFFFF, name_len, len(extra))
        return bytes(head) + entry[46 : 46 + name_len] + extra

    wide = [widened_entry(entry) for entry in entries]
    (tmp_path / "zip64").mkdir()
    widened = tmp_path / "zip64" / "small.pt"
    widened.write_bytes(_assemble(data, wide, comment=b"a comment"))
    agrees(widened)
    assert torchfile.load(widened)["w"].equal(torch.arange(1000.0))

    (tmp_path / "twice").mkdir()
    twice = tmp_path / "twice" / "small.pt"
    twice.write_bytes(_assemble(data, [*entries, entries[-1]]))
    with pytest.raises(CorruptFileError, match="given twice"):
        torchfile.load(twice)
    short = [*wide[:-1], widened_entry(entries[-1], values=1)]  # too short for the two values it must hold
    twice.write_bytes(_assemble(data, short))
    with pytest.raises(CorruptFileError, match="zip directory is missing or damaged"):
        torchfile.load(twice)


def test_a_file_of_70000_records_is_written_as_zipfile_and_torch_read_it(tmp_path: Path) -> None:
    """The writer keeps its central directory as columns and makes the entries in batches at the end (a buffer of
    95-byte entries held 18 MB per file being written at 10^5 records): past 65535 records it writes zip64 end
    records, every entry's checksum holds, and torch loads the file to what was written."""
    from ucp.io.torchzip import write_torch_file

    obj = {"module": {f"p{i}": torch.empty(0) for i in range(70000)}, "w": torch.arange(6.0)}
    path = tmp_path / "many.pt"
    written = write_torch_file(obj, path)
    raw = path.read_bytes()
    assert b"PK\x06\x06" in raw[-200:] and written.bytes == len(raw) and int(written.crc32, 16) == zlib.crc32(raw)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None and len(archive.infolist()) == 70000 + 1 + 6
    loaded = torch.load(path, weights_only=True)
    assert list(loaded["module"]) == list(obj["module"]) and torch.equal(loaded["w"], obj["w"])
