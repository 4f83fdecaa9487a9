"""ucp.io.plain_pickle: the one-pass reader for plain metadata pickles.

The promise: whatever it reads, torch's weights_only unpickler reads to the same objects (it is a
strict subset), and whatever else it meets (another global, another opcode, damage) it hands to the
full path untouched by raising NotPlain; it never calls a global off its short list.
"""

from __future__ import annotations

import gc
import io
import math
import os
import pickle
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import _weights_only_unpickler

from tests.support.files import resave
from tests.support.fixtures import Built
from tests.support.hostile import CALLS, Hostile
from ucp.errors import CorruptFileError
from ucp.io import standins, torchfile
from ucp.io.plain_pickle import NotPlain, load_plain


def _archive(path: Path) -> tuple[bytes, Callable[[], Callable[[Any], Any]]]:
    """A torch.save file's pickle, and a factory of fresh ``persistent_load`` hooks over its records."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        pickled = zf.read(next(n for n in names if n.endswith("/data.pkl")))
        records = {n.rsplit("/data/", 1)[1]: zf.read(n) for n in names if "/data/" in n}

    def hook() -> Callable[[Any], Any]:
        storages: dict[str, torch.storage.TypedStorage] = {}

        def persistent_load(pid: Any) -> torch.storage.TypedStorage:
            _, storage_type, key, _, numel = pid
            if key not in storages:  # as TorchFile makes them: fixed-size views, a growable empty one
                data = bytearray(records[key])
                raw = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if data else torch.UntypedStorage(0)
                storages[key] = torch.storage.TypedStorage(wrap_storage=raw, dtype=storage_type.dtype, _internal=True)
            return storages[key]

        return persistent_load

    return pickled, hook


def _weights_only(pickled: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """What torch's own weights_only unpickler reads (with no user globals allowed)."""
    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return unpickler.load()


def assert_same(got: Any, want: Any, where: str = "obj") -> None:
    """Same types, same values (NaN equal to NaN), tensors equal in layout and bits, OrderedDict attributes too."""
    assert type(got) is type(want), (where, type(got), type(want))
    if torch.is_tensor(want):
        layout = (want.dtype, want.shape, want.stride(), want.storage_offset(), want.requires_grad)
        assert (got.dtype, got.shape, got.stride(), got.storage_offset(), got.requires_grad) == layout, where
        got_raw, want_raw = got.untyped_storage(), want.untyped_storage()
        assert got_raw.nbytes() == want_raw.nbytes(), where
        if not want_raw.resizable():  # an empty storage a damaged tensor grew holds garbage (TorchFile refuses it)
            assert bytes(got_raw) == bytes(want_raw), where
        assert got._backward_hooks == want._backward_hooks, where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
        if isinstance(want, OrderedDict):
            assert_same(vars(got), vars(want), f"{where}.__dict__")
    elif isinstance(want, (list, tuple)) and not isinstance(want, torch.Size):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    elif isinstance(want, standins.DSObject):
        assert_same(vars(got), vars(want), f"{where}.__dict__")
    else:
        assert got == want, (where, got, want)


def _plain_sample() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    return {
        "module": module.state_dict(),  # an OrderedDict with its _metadata (BUILD)
        "views": [base, base[4:10], base.view(4, 6).t()],  # three tensors over one storage
        "empty": torch.empty(0, dtype=torch.bfloat16),
        "bf16": torch.linspace(-1, 1, 7).to(torch.bfloat16),
        "shapes": OrderedDict(w=torch.Size([3, 2]), b=torch.Size([])),
        "numbers": [0, 255, 65535, -1, 2**31 - 1, 2**40, -(2**70), 1.5, float("nan"), -0.0],
        "flags": (None, True, False),
        "text": "ünïcode ✓",
        "nested": {"a": [{"b": ()}], "c": (1, 2, 3, 4)},
        "lr_scheduler": {"base_lrs": [0.01, 0.02], "last_epoch": 1},
    }


def test_plain_reader_reads_what_weights_only_reads(tmp_path: Path) -> None:
    torch.save(_plain_sample(), tmp_path / "f.pt")
    pickled, hook = _archive(tmp_path / "f.pt")
    got = load_plain(pickled, hook())
    assert_same(got, _weights_only(pickled, hook()))
    views = got["views"]
    assert views[1].untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()  # shared, as saved


def test_torchfile_reads_plain_pickles_without_the_full_unpickler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(_plain_sample(), tmp_path / "f.pt")
    want = torchfile.load(tmp_path / "f.pt")

    def refuse(*_: Any) -> None:
        raise AssertionError("the full unpickler ran for a plain pickle")

    monkeypatch.setattr(torchfile.TorchFile, "_unpickle_full", refuse)
    assert_same(torchfile.load(tmp_path / "f.pt"), want)


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param({"scaler": standins.LossScaler(cur_scale=torch.tensor(8.0))}, id="deepspeed-standin"),
        pytest.param({"dtype": torch.float32}, id="dtype-global"),
        pytest.param({"p": torch.nn.Parameter(torch.ones(2))}, id="parameter"),
        pytest.param({"s": {1, 2}}, id="set-by-reduce"),
        pytest.param({"b": b"bytes"}, id="bytes-by-codecs"),
        pytest.param({"h": Hostile()}, id="hostile-global"),
    ],
)
def test_anything_else_is_left_to_the_full_unpickler(tmp_path: Path, obj: Any) -> None:
    resave(obj, tmp_path / "f.pt") if "scaler" in obj else torch.save(obj, tmp_path / "f.pt")
    pickled, hook = _archive(tmp_path / "f.pt")
    with pytest.raises(NotPlain):
        load_plain(pickled, hook())
    assert CALLS == []


def test_other_protocols_are_left_to_the_full_unpickler() -> None:
    for protocol in (0, 1, 3, 4, 5):
        with pytest.raises(NotPlain):
            load_plain(pickle.dumps({"a": [1, 2]}, protocol=protocol), lambda pid: None)


def test_under_any_one_byte_damage_it_reads_what_weights_only_reads_or_steps_aside(tmp_path: Path) -> None:
    """Every byte of a small plain pickle flipped (three ways): where the plain reader accepts the bytes,
    torch's weights_only unpickler accepts them too and reads the same objects."""
    sample = {"w": torch.arange(6.0).view(2, 3), "m": torch.nn.Linear(2, 1).state_dict(), "n": [1, -2, 2.5, "x"]}
    torch.save(sample, tmp_path / "f.pt")
    pickled, hook = _archive(tmp_path / "f.pt")
    accepted = 0
    for pos in range(len(pickled)):
        for damage in (pickled[pos] ^ 0x01, pickled[pos] ^ 0x20, 0):
            data = pickled[:pos] + bytes([damage]) + pickled[pos + 1 :]
            try:
                got = load_plain(data, hook())
            except NotPlain:
                continue
            accepted += 1
            assert_same(got, _weights_only(data, hook()), f"byte {pos} -> {damage}")
    assert accepted > len(pickled) // 2  # damage to values, names and lengths still reads; those were compared


@pytest.mark.slow
def test_model_states_of_a_real_zero3_checkpoint_read_plain_and_match(z3_bf16_dp2: Built) -> None:
    files = sorted(z3_bf16_dp2.tag_dir.glob("*.pt"))
    plain = 0
    for path in files:
        pickled, hook = _archive(path)
        try:
            got = load_plain(pickled, hook())
        except NotPlain:
            assert "optim_states" in path.name  # only the optimizer files hold DeepSpeed's stand-ins
            continue
        plain += 1
        with torch.serialization.safe_globals([(cls, cls.ds_name) for cls in standins.STANDINS]):
            assert_same(got, _weights_only(pickled, hook()), path.name)
    assert plain >= 2  # every model-states file


def test_empty_placeholders_are_one_tensor_per_kind_and_read_as_torch_reads(tmp_path: Path) -> None:
    """A ZeRO-3 model-states file holds an empty placeholder on its own empty storage per parameter (10^5 for a
    MoE, about 1 KB each as tensors): TorchFile makes one tensor per dtype, shape and grad flag for all of them,
    and the tree still reads as torch reads it."""
    module = OrderedDict((f"p{i}", torch.empty(0, dtype=torch.bfloat16)) for i in range(40))
    module.update(f=torch.empty(0), buf=torch.arange(3.0), g=torch.empty(0), m=torch.empty(2, 0))
    module["r"] = torch.empty(0).requires_grad_()
    torch.save({"module": module, "also": [torch.empty(0, dtype=torch.bfloat16)]}, tmp_path / "f.pt")
    want = torch.load(tmp_path / "f.pt", weights_only=True)
    with torchfile.TorchFile(tmp_path / "f.pt") as tf:
        assert_same(tf.obj, want)
        got = tf.obj["module"]
        assert all(got[f"p{i}"] is got["p0"] for i in range(40)) and tf.obj["also"][0] is got["p0"]
        assert got["f"] is got["g"] and got["f"] is not got["p0"]
        assert got["m"] is not got["f"] and got["r"] is not got["f"] and got["r"].requires_grad
        assert got["buf"].untyped_storage().nbytes() == 12 and got["buf"].tolist() == [0.0, 1.0, 2.0]


class _Ref:
    """A float32 storage record of a crafted pickle."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Placed:
    """A tensor of a crafted pickle: ``size`` on ``ref`` from its start, and a BUILD of ``state`` when given."""

    def __init__(self, ref: _Ref, size: tuple[int, ...], state: tuple[Any, ...] | None = None) -> None:
        self.ref, self.size, self.state = ref, size, state


class _Crafted(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Ref) else None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, _Placed):
            return NotImplemented
        # fresh tuples: a pickler memoizes one met twice, and a call's arguments fetched again are not plain
        args = (obj.ref, 0, tuple(list(obj.size)), tuple(1 for _ in obj.size), False, OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args) + (() if obj.state is None else (obj.state,))


def _craft(path: Path, obj: Any, records: dict[str, bytes]) -> None:
    """A torch zip file of ``obj`` pickled with :class:`_Crafted` (what torch.save cannot write)."""
    data = io.BytesIO()
    _Crafted(data, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", data.getvalue())
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
        for key, raw in records.items():
            zf.writestr(f"archive/data/{key}", raw)


def test_a_build_onto_a_shared_empty_tensor_is_left_to_the_full_unpickler(tmp_path: Path) -> None:
    """BUILD re-sets a tensor in place: onto the one empty tensor two entries share it would change both, so the
    plain reader steps aside and the file reads as torch reads it (a hand-made pickle: torch.save writes none)."""
    full = _Ref("2", 2)
    obj = {"a": _Placed(_Ref("0", 0), (0,)), "b": _Placed(_Ref("1", 0), (0,), (full, 0, (2,), (1,)))}
    _craft(tmp_path / "f.pt", obj, {"0": b"", "1": b"", "2": struct.pack("<2f", 1.5, 2.5)})
    pickled, hook = _archive(tmp_path / "f.pt")
    with pytest.raises(NotPlain, match="shared empty"):
        load_plain(pickled, hook())
    with torchfile.TorchFile(tmp_path / "f.pt") as tf:
        assert tf.obj["a"].shape == (0,) and tf.obj["b"].tolist() == [1.5, 2.5]
        assert_same(tf.obj, torch.load(tmp_path / "f.pt", weights_only=True))


def test_a_tensor_past_the_end_of_a_shared_empty_storage_is_refused(tmp_path: Path) -> None:
    """The empty storages of a file are one storage: a tensor that grows it is still found, and refused."""
    obj = {"a": _Placed(_Ref("0", 0), (0,)), "b": _Placed(_Ref("1", 0), (4,))}
    _craft(tmp_path / "f.pt", obj, {"0": b"", "1": b""})
    with pytest.raises(CorruptFileError, match="past the end of an empty storage"):
        torchfile.TorchFile(tmp_path / "f.pt")


def _rank_like(step: int) -> dict[str, Any]:
    """What each rank of one save pickles alike: the same structure, its own tensor values."""
    fragment = torch.arange(6.0) + 100 * step
    return {"module": torch.nn.Linear(2, 2).state_dict(), "frozen": {"w": fragment}, "views": [fragment[2:4]]}


def test_open_all_reads_a_repeated_pickle_once_and_gives_each_file_its_own_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [tmp_path / f"rank{r}.pt" for r in range(3)]
    for rank, path in enumerate(paths):
        torch.save(_rank_like(rank), path)
    alone = [torchfile.TorchFile(path) for path in paths]
    reads: list[int] = []
    counted = torchfile.load_plain

    def count(*args: Any) -> Any:
        reads.append(1)
        return counted(*args)

    monkeypatch.setattr(torchfile, "load_plain", count)
    files = torchfile.TorchFile.open_all(paths)
    try:
        assert len(reads) == 1  # ranks 1 and 2 were re-bound from rank 0's tree
        for tf, want in zip(files, alone):
            assert_same(tf.obj, want.obj)
            views, frozen = tf.obj["views"][0], tf.obj["frozen"]["w"]
            assert views.untyped_storage().data_ptr() == frozen.untyped_storage().data_ptr()  # still shared
            assert tf.span(frozen) is not None  # a view on its own file, as an unpickled one is
    finally:
        for tf in files + alone:
            tf.close()


def test_open_all_keeps_only_the_named_keys_of_a_repeat_on_its_own_storages(tmp_path: Path) -> None:
    """``keep``: a repeated pickle re-binds just those top-level keys (a ZeRO-3 rank's frozen fragments, not its
    module of placeholders); the first file stays whole, and a file that does not repeat is read whole."""
    paths = [tmp_path / f"rank{r}.pt" for r in range(3)]
    for rank, path in enumerate(paths[:2]):
        torch.save(_rank_like(rank), path)
    torch.save({**_rank_like(2), "extra": 1}, paths[2])  # another pickle: read the ordinary way
    alone = [torchfile.TorchFile(path) for path in paths]
    files = torchfile.TorchFile.open_all(paths, keep=("frozen", "absent"))
    try:
        assert [tf.repeats for tf in files] == [False, True, False]
        assert_same(files[0].obj, alone[0].obj)
        assert list(files[1].obj) == ["frozen"]
        assert_same(files[1].obj["frozen"], alone[1].obj["frozen"])
        assert files[1].span(files[1].obj["frozen"]["w"]) is not None  # a view on its own file
        assert_same(files[2].obj, alone[2].obj)
    finally:
        for tf in files + alone:
            tf.close()


def test_open_all_leaves_no_template_behind_for_the_garbage_collector(tmp_path: Path) -> None:
    """Each repeat is re-bound from the file before's template, which then goes at once: a re-bind that left a
    reference cycle kept every rank's template (its pickle bytes and the tree) until a full collection, eight
    copies of a 13 MB pickle for a ZeRO-3 save of 10^5 parameters at DP 8."""
    paths = [tmp_path / f"rank{r}.pt" for r in range(4)]
    for rank, path in enumerate(paths):
        torch.save(_rank_like(rank), path)
    gc.collect()
    gc.disable()
    try:
        files = torchfile.TorchFile.open_all(paths, keep=("frozen",))
        try:
            assert [tf.repeats for tf in files] == [False, True, True, True]
            assert not [o for o in gc.get_objects() if type(o) is torchfile._Template]
        finally:
            for tf in files:
                tf.close()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "pickled",
    [
        # memo entries put out of the pickler's order: past the end, then over an earlier one, then in order
        b"\x80\x02X\x01\x00\x00\x00aq\x03X\x01\x00\x00\x00bq\x00X\x01\x00\x00\x00cq\x00(h\x00h\x03t.",
        b"\x80\x02X\x01\x00\x00\x00ar\x07\x00\x00\x00X\x01\x00\x00\x00bq\x00X\x01\x00\x00\x00cr"
        b"\x01\x00\x00\x00(h\x00h\x01j\x07\x00\x00\x00t.",
        b"\x80\x02X\x01\x00\x00\x00aq\x01X\x01\x00\x00\x00bq\x00X\x01\x00\x00\x00cq\x01(h\x00h\x01t.",
    ],
)
def test_memo_entries_out_of_order_read_as_pickle_reads_them(pickled: bytes) -> None:
    """The memo is a list while the pickle numbers it 0, 1, 2... (every pickler does), and anything else
    still reads as pickle reads it, or steps aside: a later put wins, a missing entry is not plain."""
    assert load_plain(pickled, lambda pid: None) == pickle.loads(pickled)
    with pytest.raises(NotPlain):
        load_plain(b"\x80\x02X\x01\x00\x00\x00aq\x00h\x01.", lambda pid: None)


def test_a_call_s_arguments_fetched_again_are_left_to_the_full_unpickler(tmp_path: Path) -> None:
    """Once a call is made, the memo lets go of its argument tuples (a pickler made them for that call); a pickle
    that fetches one again is not plain, and a TorchFile reads it the full way, to what torch reads."""
    spent = b"\x80\x02ctorch\nSize\nq\x00K\x01K\x02\x86q\x01\x85q\x02Rq\x03h\x02\x86q\x04."
    kept = spent.replace(b"Rq\x03h\x02", b"Rq\x03h\x03")  # the call's result fetched again: plain
    with pytest.raises(NotPlain, match="fetched again"):
        load_plain(spent, lambda pid: None)
    assert load_plain(kept, lambda pid: None) == pickle.loads(kept) == (torch.Size([1, 2]), torch.Size([1, 2]))
    with zipfile.ZipFile(tmp_path / "spent.pt", "w") as zf:
        zf.writestr("archive/data.pkl", spent)
        zf.writestr("archive/byteorder", "little")
    with torchfile.TorchFile(tmp_path / "spent.pt") as tf:
        assert tf.obj == pickle.loads(spent) == (torch.Size([1, 2]), ((1, 2),))


def test_a_pickle_is_searched_for_a_key_without_reading_it(tmp_path: Path) -> None:
    """pickle_mentions: a certain no for a key the pickle does not hold, a yes for one it does, and a yes where it
    cannot tell (a legacy file or a damaged one: the full read decides and words the error)."""
    torch.save({"ds_autoep_layers": [], "w": torch.zeros(3)}, tmp_path / "with.pt")
    torch.save({"module": {"w": torch.zeros(3)}}, tmp_path / "without.pt")
    torch.save({"w": torch.zeros(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "damaged.pt").write_bytes((tmp_path / "without.pt").read_bytes()[:-30])
    assert torchfile.pickle_mentions(tmp_path / "with.pt", "ds_autoep_layers")
    assert not torchfile.pickle_mentions(tmp_path / "without.pt", "ds_autoep_layers")
    assert torchfile.pickle_mentions(tmp_path / "legacy.pt", "ds_autoep_layers")
    assert torchfile.pickle_mentions(tmp_path / "damaged.pt", "ds_autoep_layers")
    assert torchfile.pickle_mentions(tmp_path / "missing.pt", "ds_autoep_layers")
    os.mkfifo(tmp_path / "fifo.pt")  # no writer: opening it plainly would block
    assert torchfile.pickle_mentions(tmp_path / "fifo.pt", "ds_autoep_layers")


def test_open_all_reports_a_broken_repeat_as_opening_it_alone_does(tmp_path: Path) -> None:
    torch.save(_rank_like(0), tmp_path / "rank0.pt")
    pickled, _ = _archive(tmp_path / "rank0.pt")
    with zipfile.ZipFile(tmp_path / "rank1.pt", "w") as zf:  # the same pickle, its tensor records missing
        zf.writestr("archive/data.pkl", pickled)
        zf.writestr("archive/byteorder", "little")
    with pytest.raises(torchfile.CorruptFileError) as alone:
        torchfile.TorchFile(tmp_path / "rank1.pt")
    with pytest.raises(torchfile.CorruptFileError) as together:
        torchfile.TorchFile.open_all([tmp_path / "rank0.pt", tmp_path / "rank1.pt"])
    assert str(together.value) == str(alone.value) and "missing from the archive" in str(alone.value)


@pytest.mark.slow
def test_open_all_reads_the_optim_files_of_a_real_save_once(
    z3_bf16_dp2: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ZeRO-3 save's optim files name DeepSpeed's classes (the full unpickler reads them) and repeat each other's
    pickle: the first is unpickled, the rest re-bound, stand-ins included, each onto its own file's tensors."""
    paths = sorted(z3_bf16_dp2.tag_dir.glob("*optim_states.pt"))
    assert len(paths) == 2
    alone = [torchfile.TorchFile(path) for path in paths]
    full: list[int] = []
    counted = torchfile.TorchFile._unpickle_full

    def count(self: torchfile.TorchFile, *args: Any) -> Any:
        full.append(1)
        return counted(self, *args)

    monkeypatch.setattr(torchfile.TorchFile, "_unpickle_full", count)
    files = torchfile.TorchFile.open_all(paths)
    try:
        assert len(full) == 1
        for tf, want in zip(files, alone):
            assert_same(tf.obj, want.obj, tf.path.name)
            flat = tf.obj["optimizer_state_dict"]["fp32_flat_groups"][0]
            assert tf.span(flat) is not None  # a view on its own file
        scaler = [tf.obj["optimizer_state_dict"].get("loss_scaler") for tf in files]
        assert scaler[0] is not None and scaler[0] is not scaler[1]  # each file its own stand-in object
    finally:
        for tf in files + alone:
            tf.close()
