"""verl FSDP checkpoints (verl 0.9.1 ``FSDPCheckpointManager``): read by ucp, written by ucp for another number of
processes, loaded by verl's own ``load_checkpoint`` with no manual step, compared with verl's own resume.

Fast tier: real DCP folders and verl folders made in this process with torch alone (no verl, no launched run): the
writer's folders read back bit for bit, torch itself reads the DTensors written, bad folders fail in one line.
Slow tier (needs verl): real runs on gloo CPU ranks (tests/support/verl_worker.py), FSDP1 (verl's default flat
parameters, with a device mesh) and FSDP2, fp32, saved at 2 processes after 2 steps.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from ucp.errors import ConfigError, CorruptFileError, InputError, UnsafeFileError
from ucp.model.fsdp_shards import rank_pieces, row_bounds, units_in_order
from ucp.sources import open_reader
from ucp.targets.dcp import write_dcp
from ucp.targets.verl import write_verl

#: fp32 at another world size sums in another order; measured differences here are at most 4.8e-7
_LOSS_TOL = 1e-5


# -- a real single-process source: torch's own DCP save of a small stepped model ---------------------------------
class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)
        self.norm = torch.nn.Parameter(torch.ones(6))


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.norm = torch.nn.Parameter(torch.ones(6))


class _Tiny(torch.nn.Module):
    """Llama-like names (``model.layers.<i>.``: verl's FSDP1 units), a vocabulary of 11 rows: ragged shards."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = torch.nn.Linear(6, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed(ids)
        for layer in self.model.layers:
            h = torch.tanh(layer.proj(h)) * layer.norm
        return self.lm_head(h * self.model.norm).pow(2).mean()


def _dcp_source(root: Path, groups: int = 1) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A DCP folder of the tiny model after 2 AdamW steps (``get_state_dict``'s model/optim, one process), and the
    live state by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = _Tiny()
    params = list(model.parameters())
    group_list = (
        [{"params": params}] if groups == 1 else [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    )
    optimizer = torch.optim.AdamW(group_list, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    for _ in range(2):
        model(torch.randint(0, 11, (4, 5))).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    path = root / "dcp"
    dcp.save({"model": msd, "optim": osd, "lr_scheduler": scheduler.state_dict()}, checkpoint_id=path, no_dist=True)
    live = {
        n: {"fp32": p.detach().clone(), **{k: v.clone() for k, v in osd["state"][n].items()}} for n, p in msd.items()
    }
    return path, live


def _read_all(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    with open_reader(path) as reader:
        out = {}
        for meta in reader.facts.params:
            state = reader.read(meta.name)
            out[meta.name] = {"fp32": state.fp32, **state.optim, "step": torch.tensor(float(state.step or 0))}
        return out


def _assert_same(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> None:
    assert got.keys() == want.keys() and want
    for name, tensors in want.items():
        for key, value in tensors.items():
            assert torch.equal(got[name][key].to(value.dtype), value), f"{name} {key} differs"


@pytest.mark.parametrize("version,world", [(2, 1), (2, 3), (2, 4), (1, 1), (1, 2), (1, 3)])
def test_verl_folder_written_from_a_dcp_folder_reads_back_bit_for_bit(tmp_path: Path, version: int, world: int) -> None:
    src, live = _dcp_source(tmp_path)
    result = write_verl(src, tmp_path / "actor", dp=world, fsdp_version=version, device="cpu")
    names = sorted(p.name for p in (tmp_path / "actor").iterdir() if not p.name.startswith(".ucp-"))
    assert names == sorted(
        ["fsdp_config.json"]
        + [f"{k}_world_size_{world}_rank_{r}.pt" for k in ("model", "optim", "extra_state") for r in range(world)]
    )
    assert any("no huggingface/" in n for n in result.notes)
    _assert_same(_read_all(tmp_path / "actor"), live)
    with open_reader(tmp_path / "actor") as reader:
        assert reader.format == "verl-fsdp" and reader.facts.info.dp_world_size == world
        assert reader.extras()["lr_scheduler"]["last_epoch"] == 2
        assert reader.facts.groups[0].hyper.weight_decay == 0.01


@pytest.mark.parametrize("version", [1, 2])
def test_each_rank_reads_only_its_share_of_a_streamed_state(tmp_path: Path, monkeypatch, version: int) -> None:
    """Written from a universal directory (a reader that streams), each rank's file reads only the rows (FSDP2) or
    the flat shard (FSDP1) it holds, never a whole state: every copy out of the source is at most one rank's share,
    smaller than the largest tensor; and the folder reads back bit for bit."""
    from ucp.model.pieces import Pieces

    src, live = _dcp_source(tmp_path)
    ucp.to_universal(src, tmp_path / "u")
    copied: list[int] = []
    copy_to = Pieces.copy_to

    def counted(self, out, staging=None):
        copied.append(out.numel())
        return copy_to(self, out, staging)

    monkeypatch.setattr(Pieces, "copy_to", counted)
    write_verl(tmp_path / "u", tmp_path / "actor", dp=3, fsdp_version=version, device="cpu")
    monkeypatch.undo()
    shapes = {n: tuple(t["fp32"].shape) for n, t in live.items()}
    if version == 2:  # a rank's rows: ceil(rows / 3) of them
        share = max(-(-s[0] // 3) * int(torch.Size(s[1:]).numel()) for s in shapes.values())
    else:  # a unit's flat shard: ceil(numel / 3)
        share = max(-(-sum(int(torch.Size(shapes[n]).numel()) for n in m) // 3) for _, m in units_in_order(list(live)))
    largest = max(int(torch.Size(s).numel()) for s in shapes.values())
    assert copied and max(copied) <= share < largest, (max(copied), share, largest)
    _assert_same(_read_all(tmp_path / "actor"), live)


def test_written_dtensors_are_what_torch_itself_loads(tmp_path: Path) -> None:
    """torch.load(weights_only=True) with torch's own DTensor classes, no process group: Shard(0) on the 1-D fsdp
    mesh of 3, rank 2's rows of the 11-row embedding (4, 4, 3), the optimizer's moments alike."""
    from torch.distributed.tensor import DTensor, Shard

    src, live = _dcp_source(tmp_path)
    write_verl(src, tmp_path / "actor", dp=3, fsdp_version=2, device="cpu")
    model = torch.load(tmp_path / "actor" / "model_world_size_3_rank_2.pt", weights_only=True)
    embed = model["model.embed.weight"]
    assert isinstance(embed, DTensor) and embed.placements == (Shard(0),) and embed.shape == (11, 6)
    assert embed.device_mesh.mesh_dim_names == ("fsdp",) and embed.device_mesh.size() == 3
    assert torch.equal(embed._local_tensor, live["model.embed.weight"]["fp32"][8:11])
    optim = torch.load(tmp_path / "actor" / "optim_world_size_3_rank_2.pt", weights_only=True)
    assert optim["param_groups"][0]["params"] == list(range(len(live)))
    first = list(live)[0]  # model.parameters() order: a module's own parameters before its children's
    assert first == "model.norm" and optim["state"][0]["exp_avg"].shape == (6,)
    assert torch.equal(optim["state"][0]["exp_avg"]._local_tensor, live[first]["exp_avg"][4:6])


def test_fsdp1_optimizer_files_hold_padded_flat_shards_per_unit(tmp_path: Path) -> None:
    """Root unit first (embedding, final norm, head), then each layer; each rank's shard ceil(N / 3) long."""
    src, live = _dcp_source(tmp_path)
    write_verl(src, tmp_path / "actor", dp=3, fsdp_version=1, device="cpu")
    units = units_in_order(list(live))
    assert [u for u, _ in units] == ["", "model.layers.0", "model.layers.1"]
    flat = {u: torch.cat([live[n]["exp_avg"].reshape(-1) for n in members]) for u, members in units}
    for rank in range(3):
        optim = torch.load(tmp_path / "actor" / f"optim_world_size_3_rank_{rank}.pt", weights_only=True)
        for index, (unit, _) in enumerate(units):
            chunk = -(-flat[unit].numel() // 3)
            shard = optim["state"][index]["exp_avg"]
            want = torch.nn.functional.pad(flat[unit], (0, 3 * chunk - flat[unit].numel()))[
                rank * chunk : (rank + 1) * chunk
            ]
            assert shard.shape == (chunk,) and torch.equal(shard, want)


def test_row_bounds_are_torch_chunk_sizes_and_pieces_cover_each_element_once() -> None:
    for rows in range(0, 13):
        for world in range(1, 6):
            sizes = [b - a for a, b in row_bounds(rows, world)]
            chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
            assert sizes == chunks + [0] * (world - len(chunks)) and sum(sizes) == rows
    for start, numel, chunk in [(0, 10, 4), (5, 10, 4), (3, 1, 4), (8, 8, 8)]:
        pieces = rank_pieces(start, numel, chunk)
        assert sum(p[3] for p in pieces) == numel
        assert all(0 <= inner and inner + length <= chunk for _, inner, _, length in pieces)
        assert [at for _, _, at, _ in pieces] == [sum(p[3] for p in pieces[:i]) for i in range(len(pieces))]


def test_two_param_groups_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    src, _ = _dcp_source(tmp_path, groups=2)
    with pytest.raises(ConfigError, match="2 param groups; verl's actor optimizer is one group"):
        write_verl(src, tmp_path / "out", dp=2, device="cpu")
    assert not (tmp_path / "out").exists()


class Intruder:
    """A class no checkpoint may name."""


def _break(actor: Path, how: str) -> None:
    target = actor / "model_world_size_2_rank_1.pt"
    if how == "missing":
        target.unlink()
    elif how == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "unexpected class":
        torch.save({"model.embed.weight": Intruder()}, target)
    elif how == "other placement":  # a replicated entry (torch's own classes): not what verl's actor saves
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        state = torch.load(target, weights_only=True)
        entry = state["model.embed.weight"]
        entry._spec = DTensorSpec(entry.device_mesh, (Replicate(),), tensor_meta=entry._spec.tensor_meta)
        torch.save(state, target)


_BROKEN = {
    "missing": (InputError, "rank file model_world_size_2_rank_1.pt is missing from .*: the checkpoint was saved by 2"),
    "truncated": (CorruptFileError, "model_world_size_2_rank_1.pt is truncated or corrupt"),
    "unexpected class": (UnsafeFileError, "refers to tests.test_verl.Intruder, which is not on ucp's allow-list"),
    "other placement": (
        InputError,
        "model.embed.weight \\(rank 1\\) is a DTensor placed as Replicate; ucp reads Shard\\(0\\) on a 1-D",
    ),
}


@pytest.mark.parametrize("how", list(_BROKEN))
def test_a_broken_verl_folder_fails_in_one_line(tmp_path: Path, how: str) -> None:
    src, _ = _dcp_source(tmp_path)
    write_verl(src, tmp_path / "actor", dp=2, fsdp_version=2, device="cpu")
    _break(tmp_path / "actor", how)
    kind, message = _BROKEN[how]
    with pytest.raises(kind, match=message) as err:
        with open_reader(tmp_path / "actor") as reader:
            for meta in reader.facts.params:
                reader.read(meta.name)
    assert "\n" not in str(err.value)


def test_a_run_folder_naming_its_latest_step_reads_as_that_actor_folder(tmp_path: Path) -> None:
    """``<dir>/latest_checkpointed_iteration.txt`` (verl's PPO trainer) names global_step_N; N is the global step."""
    src, live = _dcp_source(tmp_path)
    write_verl(src, tmp_path / "run" / "global_step_7" / "actor", dp=2, device="cpu")
    (tmp_path / "run" / "global_step_7" / "data.pt").write_bytes(b"dataloader state")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("7\n")
    with open_reader(tmp_path / "run") as reader:
        assert reader.format == "verl-fsdp" and reader.facts.info.global_steps == 7
        assert any("not carried: data.pt" in w for w in reader.facts.warnings)
    _assert_same(_read_all(tmp_path / "run"), live)


def test_verl_target_refuses_deepspeed_options_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ucp.cli import main

    src, _ = _dcp_source(tmp_path)
    assert main(["restore", str(src), str(tmp_path / "out"), "--format", "verl-fsdp", "--dp", "2", "--stage", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "ucp: error: --stage describes a DeepSpeed output; a verl actor folder holds fp32 masters sharded by FSDP: drop it"
    )
    assert not (tmp_path / "out").exists()


# -- real verl runs ------------------------------------------------------------------------------------------------
def _runs() -> Any:
    pytest.importorskip("verl")
    from tests.support import verl_runs

    return verl_runs


def _source(fsdp: int) -> Any:
    runs = _runs()
    from tests.support.verl_worker import VerlSpec

    return runs.cached_verl(f"fsdp{fsdp}-w2-save", VerlSpec(world=2, fsdp=fsdp))


def _native(fsdp: int) -> Any:
    """verl's own resume of the source at 2 processes."""
    from tests.support.verl_worker import VerlSpec

    saved = _source(fsdp)
    return _runs().cached_verl(f"fsdp{fsdp}-w2-native", VerlSpec(world=2, fsdp=fsdp, load=str(saved.actor)))


def _live(record: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v for k, v in t.items()} for n, t in record["state"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [1, 2])
def test_verl_read_is_the_live_state_at_save(fsdp: int) -> None:
    """Every weight, moment and step as the live run held them when it saved; the group, the scheduler, the global
    step (the folder's N) and the world size; from the actor folder and from its global_step_N folder alike."""
    from tests.support.hf_runs import tree_digest

    saved = _source(fsdp)
    record = saved.saved()
    before = tree_digest(saved.out)
    for path in (saved.actor, saved.actor.parent):
        _assert_same(_read_all(path), _live(record))
        with open_reader(path) as reader:
            facts = reader.facts
            assert reader.format == "verl-fsdp" and reader.inputs == (path,)
            assert facts.info.global_steps == 2 and facts.info.dp_world_size == 2
            assert facts.flavour == "torch-adam" and facts.adam_w_mode is True and len(facts.groups) == 1
            hyper = facts.groups[0].hyper
            assert (hyper.lr, hyper.weight_decay, hyper.betas) == (record["groups"][0]["lr"], 0.01, (0.9, 0.999))
            assert reader.extras()["lr_scheduler"] == record["scheduler"]
            assert any("RNG state" in w for w in facts.warnings)
            assert any(f"FSDP{fsdp}" in w for w in facts.warnings)
    assert tree_digest(saved.out) == before, "ucp changed its input"


#: saves verl makes with other settings: read, not written (FSDP1 use_orig_params, FSDP1 without a device mesh), and
#: at 3 processes (ragged rows, padded flat shards)
_OTHER_SAVES = {
    "fsdp1-orig-params": {"fsdp": 1, "use_orig_params": True},
    "fsdp1-no-mesh": {"fsdp": 1, "mesh": False},
    "fsdp1-w3": {"fsdp": 1, "world": 3},
    "fsdp2-w3": {"fsdp": 2, "world": 3},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_OTHER_SAVES))
def test_verl_read_of_other_saves_is_the_live_state(name: str) -> None:
    from tests.support.verl_worker import VerlSpec

    fields = {"world": 2, **_OTHER_SAVES[name]}
    saved = _runs().cached_verl(f"{name}-save", VerlSpec(**fields))
    _assert_same(_read_all(saved.actor), _live(saved.saved()))
    with open_reader(saved.actor) as reader:
        assert reader.facts.info.dp_world_size == fields["world"]
        layout = "fsdp1-orig-params" if fields.get("use_orig_params") else f"fsdp{fields['fsdp']}"
        assert any(layout in w for w in reader.facts.warnings), reader.facts.warnings


@pytest.mark.slow
@pytest.mark.parametrize("fsdp,world", [(2, 1), (2, 3), (1, 1), (1, 3)])
def test_verl_loads_what_ucp_wrote_for_another_world_size(fsdp: int, world: int, tmp_path: Path) -> None:
    """verl's load_checkpoint at the new size holds what its own load of the source at 2 holds, bit for bit; the
    next 3 steps' losses match verl's own resume within fp32's summation order."""
    from tests.support.verl_worker import VerlSpec

    saved, native = _source(fsdp), _native(fsdp)
    result = write_verl(saved.actor, tmp_path / "global_step_2" / "actor", dp=world)
    assert result.version == fsdp and result.device == "cpu"  # both from the source
    assert (tmp_path / "global_step_2" / "actor" / "huggingface" / "config.json").is_file()
    run = _runs().run_verl(
        VerlSpec(world=world, fsdp=fsdp, load=str(tmp_path / "global_step_2" / "actor"), record=str(tmp_path / "rec"))
    )
    loaded, want = run.loaded(), native.loaded()
    _assert_same(_live(loaded), _live(want))
    _assert_same(_live(want), _live(saved.saved()))
    assert loaded["groups"] == want["groups"] and loaded["scheduler"] == want["scheduler"]
    got, ref = run.losses(), native.losses()
    assert sorted(got) == sorted(ref) == [3, 4, 5]
    worst = max(abs(got[s] - ref[s]) for s in ref)
    assert worst < _LOSS_TOL, f"losses differ by {worst:.2e} at {world} processes"


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [1, 2])
@pytest.mark.parametrize("via", ["dcp", "deepspeed"])
def test_verl_round_trips_through_dcp_and_deepspeed(fsdp: int, via: str, tmp_path: Path) -> None:
    """verl -> DCP or a DeepSpeed ZeRO-3 checkpoint for 3 -> verl for 2: each step equal to the source (ucp diff)."""
    saved = _source(fsdp)
    middle = tmp_path / via
    if via == "dcp":
        write_dcp(saved.actor, middle)
    else:
        ucp.write_native(saved.actor, middle, dp=3, stage=3)
    write_verl(middle, tmp_path / "back", dp=2, fsdp_version=fsdp, device="cpu")
    for out in (middle, tmp_path / "back"):
        report = ucp.diff(saved.actor, out)
        assert report.equal, "\n".join(report.lines())


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [1, 2])
def test_export_of_a_verl_checkpoint_loads_with_from_pretrained(fsdp: int, tmp_path: Path) -> None:
    """ucp export carries huggingface/config.json; the weights are the live ones (FSDP1 too, which verl's own
    model merger cannot read)."""
    from transformers import AutoModelForCausalLM

    from ucp.cli import main

    saved = _source(fsdp)
    assert main(["export", str(saved.actor), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    weights = model.state_dict()
    for name, tensors in saved.saved()["state"].items():
        assert torch.equal(weights[name], tensors["fp32"]), name


@pytest.mark.slow
def test_restore_cli_writes_a_verl_folder_that_a_missing_rank_file_then_breaks(tmp_path: Path) -> None:
    from ucp.cli import main

    saved = _source(2)
    copy = Path(shutil.copytree(saved.out, tmp_path / "src"))
    out = tmp_path / "out"
    assert main(["restore", str(copy / "global_step_2"), str(out), "--format", "verl-fsdp", "--dp", "3"]) == 0
    assert (out / "model_world_size_3_rank_2.pt").is_file()
    _assert_same(_read_all(out), _live(saved.saved()))
    (copy / "global_step_2" / "actor" / "optim_world_size_2_rank_0.pt").unlink()
    with pytest.raises(InputError, match="rank file optim_world_size_2_rank_0.pt is missing"):
        open_reader(copy / "global_step_2")
