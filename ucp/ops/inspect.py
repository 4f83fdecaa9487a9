"""``ucp inspect``: what a checkpoint holds, from its metadata alone.

Both a DeepSpeed ZeRO checkpoint and a universal directory answer through the same
:class:`ucp.model.records.Reader` facts, so the report has one shape whatever the input. No tensor is
assembled: a DeepSpeed checkpoint is only unpickled onto a read-only mmap, a universal directory is
read from its ``ucp.json``. The report is plain JSON data; :func:`format_report` renders it for people.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ucp.deepspeed import states as ds_states
from ucp.model import flavours
from ucp.model.detect import low_precision_masters, round_robin_gradients
from ucp.model.records import Facts, Reader
from ucp.sources import open_reader, source_format
from ucp.universal.manifest import source_layouts
from ucp.universal.reader import UniversalReader

__all__ = ["inspect_path", "inspect_reader", "format_report"]

logger = logging.getLogger(__name__)

#: torch's per-run switches: how the new run computes, not what the checkpoint means
_SWITCHES = ("foreach", "maximize", "capturable", "differentiable", "fused")
#: the report's ``format`` by the source format's family: a ds_to_universal folder is a universal checkpoint too
#: (DeepSpeed's flavour of one); the formats not named here report their own name
_KINDS = {"deepspeed": "deepspeed", "ds-universal": "universal"}


def inspect_path(path: str | os.PathLike, *, tag: str | None = None, optimizer: str | None = None) -> dict[str, Any]:
    """Summarize the checkpoint or universal directory at ``path`` as one JSON-ready dict."""
    path = Path(path)
    with open_reader(path, tag=tag, optimizer=optimizer, verify=False) as reader:
        return inspect_reader(reader, path=path)


def _kind(reader: Reader) -> str:
    """``format`` of the report: deepspeed, universal, dcp, hf-trainer, hf-accelerate, ..."""
    if not reader.format:
        return "universal" if isinstance(reader, UniversalReader) else _KINDS.get(reader.facts.info.format, "deepspeed")
    chosen = source_format(reader.format)
    return _KINDS.get(chosen.family or chosen.name, chosen.name)


def _adam_w_mode(facts: Facts) -> bool | None:
    """The optimizer-wide flag, else what every group says (torch AdamW records it per group only)."""
    if facts.adam_w_mode is not None:
        return facts.adam_w_mode
    modes = {g.hyper.adam_w_mode for g in facts.groups}
    return modes.pop() if len(modes) == 1 else None


def inspect_reader(reader: Reader, *, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The report for an already open reader."""
    facts = reader.facts
    info = facts.info
    steps = reader.param_steps()
    params = [
        {
            "name": p.name,
            "shape": list(p.shape),
            "numel": p.numel,
            "dtype": p.dtype,
            "group": p.group,
            "frozen": p.frozen,
            "step": steps.get(p.name),
        }
        for p in facts.params
    ]
    numel_of = {p.name: p.numel for p in facts.params}
    groups = [
        {
            "index": g.index,
            "hyperparameters": g.hyper.to_json(),
            "settings": dict(g.raw),
            "state_keys": list(g.state_keys),
            "step": g.step,
            "num_params": len(g.params),
            "numel": sum(numel_of.get(n, 0) for n in g.params),
            "params": list(g.params),
        }
        for g in facts.groups
    ]
    frozen = [p for p in facts.params if p.frozen]
    report: dict[str, Any] = {
        "path": str(path) if path is not None else None,
        "format": _kind(reader),
        "source_format": info.format,
        "tag": info.tag,
        "ds_version": info.ds_version,
        "zero_stage": info.zero_stage,
        "dp_world_size": info.dp_world_size,
        "replicas": info.replicas,
        "mp_world_size": info.mp_world_size,
        "dtype": info.dtype,
        "optimizer": facts.flavour or "unknown",
        "optimizer_family": flavours.FLAVOURS[facts.flavour].family if facts.flavour in flavours.FLAVOURS else None,
        "adam_w_mode": _adam_w_mode(facts),
        "step": facts.step,
        "global_steps": info.global_steps,
        "skipped_steps": info.skipped_steps,
        "global_samples": info.global_samples,
        "sub_group_size": info.sub_group_size,
        "num_params": len(facts.params),
        "numel": sum(p.numel for p in facts.params),
        "num_frozen": len(frozen),
        "frozen_numel": sum(p.numel for p in frozen),
        "param_groups": groups,
        "params": params,
        "tied": dict(facts.tied),
        "buffers": list(facts.buffer_names),
        "warnings": list(facts.warnings),
        "tensor_parallel": dict(facts.tp_rules),
        "low_precision_masters": _masters(info.ds_config),
        # ZeRO-1/2 flat groups in round-robin order: a restore keeps the setting unless told
        "round_robin_gradients": info.zero_stage in (1, 2) and round_robin_gradients(info.ds_config),
        "loss_scale": _loss_scale(reader),
    }
    # a pipeline-parallel source's stages, a mixture-of-experts source's MoE or AutoEP layers (a universal directory
    # keeps its source's in ucp.json)
    report.update(source_layouts(reader))
    if isinstance(reader, UniversalReader):
        report["format_version"] = reader.manifest.get("format_version")
        report["created_by"] = reader.manifest.get("created_by")
    if facts.folder is not None:
        report["hf"] = facts.folder.describe()
    if facts.megatron is not None:
        report["megatron"] = facts.megatron.describe()
    return report


def _loss_scale(reader: Reader) -> dict[str, Any] | None:
    """An fp16 source's loss scaler, as its numbers (what a restore carries to an fp16 run)."""
    if reader.facts.info.dtype != "fp16":
        return None
    scale = ds_states.loss_scale_of(reader.extras().get("loss_scaler"))
    return None if scale is None else scale.scaler_fields()


def _loss_scale_line(scale: dict[str, Any]) -> str:
    """``loss scale dynamic, now 32768 (window 1000, hysteresis 1 of 2 left, minimum 1, last overflow at 4)``."""
    now = scale["cur_scale"]
    now = f"{int(now)}" if float(now).is_integer() else f"{now:g}"
    if not scale["dynamic"]:
        return f"  loss scale static, {now}"
    last = scale["last_overflow_iter"]
    return (
        f"  loss scale dynamic, now {now} (window {scale['scale_window']}, hysteresis "
        f"{scale['cur_hysteresis']} of {scale['delayed_shift']} left, minimum {scale['min_scale']:g}, "
        + ("no overflow yet)" if last < 0 else f"last overflow at iteration {last})")
    )


def _masters(ds_config: dict[str, Any]) -> dict[str, str] | None:
    low = low_precision_masters(ds_config)
    return None if low is None else {"masters": low.masters, "state": low.state, "option": low.option}


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _rule_text(rule: dict[str, Any] | None) -> str:
    """``split dim 0 [23+23]``, ``replicated``: one tensor-parallel rule for the table."""
    if rule is None:
        return "-"
    if rule["kind"] != "split":
        return rule["kind"]
    text = f"split dim {rule.get('dim', 0)}"
    if rule.get("parts"):
        text += " [" + "+".join(map(str, rule["parts"])) + "]"
    if rule.get("vocab") is not None:
        text += f" vocab {rule['vocab']}/{rule.get('padded')}"
    return text


#: how ``ucp inspect`` names what holds an FSDP run's model and optimizer
_FSDP_HOLDERS = {"fsdp-sharded": "FSDP SHARDED_STATE_DICT", "fsdp-full": "FSDP FULL_STATE_DICT"}


def _hf_lines(hf: dict[str, Any]) -> list[str]:
    """What a Trainer or Accelerate folder holds around its DeepSpeed tag or its FSDP state."""
    kind = "Hugging Face Trainer" if hf["kind"] == "trainer" else "Accelerate save_state"
    step = f", global_step {hf['global_step']}" if hf["global_step"] is not None else ""
    holder = _FSDP_HOLDERS.get(hf["backend"])
    state = f"{holder} ({', '.join(hf['state'])})" if holder else f"DeepSpeed tag {hf['tag']}"
    lines = [
        f"  {kind} folder{step}: {state}, RNG files for {hf['processes'] or 0} "
        f"process{'' if hf['processes'] == 1 else 'es'} "
        f"({', '.join(hf['rng_files']) or 'none'})",
        f"  other files (copied unchanged by ucp restore): {', '.join(hf['files']) or 'none'}",
    ]
    if hf["skipped"]:
        lines.append(f"  other DeepSpeed tags, not carried by ucp restore: {', '.join(hf['skipped'])}")
    return lines


def _layout_line(report: dict[str, Any]) -> str:
    """Where the state came from: a DCP folder has no ZeRO stage, DeepSpeed version or tag to show."""
    megatron = report.get("megatron")
    if megatron:
        model = megatron["model"]
        sizes = ", ".join(f"{k} {model[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads") if k in model)
        return (
            f"  Megatron-Core torch_dist, saved at tp={megatron['tp']} pp={megatron['pp']} dp={megatron['dp']}, "
            f"optimizer state {megatron['sharding']}, dtype {report['dtype']}" + (f"; {sizes}" if sizes else "")
        )
    if report.get("hf", {}).get("backend") == "fsdp-full":
        return f"  whole torch files, saved at {report['dp_world_size']} process(es), dtype {report['dtype']}"
    if report["format"] == "dcp" or report.get("source_format") == "dcp":
        return f"  torch.distributed.checkpoint, saved at {report['dp_world_size']} rank(s), dtype {report['dtype']}"
    return (
        f"  ZeRO stage {report['zero_stage']}, dp={report['dp_world_size']}"
        + (f" (MiCS: {report['dp_world_size'] * report['replicas']} ranks)" if report.get("replicas", 1) > 1 else "")
        + f", mp={report['mp_world_size']}, "
        f"dtype {report['dtype']}, DeepSpeed {report['ds_version'] or '?'}, tag {report['tag'] or '-'}"
    )


def _pipeline_lines(pipeline: dict[str, Any], dp: int) -> list[str]:
    """A pipeline source's stages: the files each wrote, its layers and parameters, the tied modules."""
    tp = f" x tp={pipeline['tp']}" if pipeline.get("tp", 1) > 1 else ""
    lines = [f"  pipeline: {pipeline['pp']} stages{tp} x dp={dp}, merged into whole parameters"]
    for stage in pipeline["stages"]:
        layers = ", ".join(map(str, stage["layers"])) or "none"
        lines.append(
            f"    stage {stage['stage']}: {stage['model_file']} + {stage['optim_files']} optim files, layer files "
            f"{layers}; {len(stage['params'])} optimized params, {_fmt_int(stage['numel'])} elements"
        )
    for name, stages in pipeline["tied_across_stages"].items():
        lines.append(
            f"    tied across stages {', '.join(map(str, stages))}: {name} (kept once, from stage {stages[0]})"
        )
    return lines


def _moe_lines(moe: dict[str, Any]) -> list[str]:
    """A MoE source's layers: module, experts, expert-parallel size; experts named by global index."""
    return _expert_lines(f"mixture of experts: {len(moe['layers'])} MoE layers on {moe['world']} ranks", moe["layers"])


def _autoep_lines(autoep: dict[str, Any]) -> list[str]:
    """An AutoEP source's layers, as a MoE source's: its fused experts are read as one parameter per expert."""
    title = f"AutoEP: {len(autoep['layers'])} layers on {autoep['world']} ranks at autoep_size={autoep['ep_size']}"
    return _expert_lines(title, autoep["layers"])


def _expert_lines(title: str, layers: list[dict[str, Any]]) -> list[str]:
    lines = [f"  {title}, experts by global index"]
    for layer in layers:
        lines.append(
            f"    layer {layer['layer']}: {layer['module']}, {layer['experts']} experts at ep_size={layer['ep_size']}"
        )
    return lines


def format_report(report: dict[str, Any]) -> str:
    """A short summary and a per-parameter table, for a terminal."""
    lines = [
        f"{report['path']}: {report['format']} checkpoint"
        + (f" (from {report['source_format']})" if report["format"] == "universal" else ""),
        _layout_line(report),
        f"  optimizer {report['optimizer']}"
        + ("" if report["adam_w_mode"] is None else f" (adam_w_mode={report['adam_w_mode']})")
        + f", step {report['step'] if report['step'] is not None else '-'}, "
        f"global_steps {report['global_steps']}, skipped_steps {report['skipped_steps']}",
        f"  {report['num_params']} parameters, {_fmt_int(report['numel'])} elements"
        f" ({report['num_frozen']} frozen, {_fmt_int(report['frozen_numel'])} elements)",
    ]
    low = report.get("low_precision_masters")
    if low:
        lines.insert(2, f"  masters {low['masters']} ({low['option']}), optimizer state {low['state']}")
    if report.get("loss_scale"):
        lines.insert(2, _loss_scale_line(report["loss_scale"]))
    if report.get("round_robin_gradients"):
        lines.insert(2, "  round_robin_gradients: each param group flattened in round-robin order over the ranks")
    if report.get("hf"):
        lines[1:1] = _hf_lines(report["hf"])
    if report.get("pipeline"):
        lines[2:2] = _pipeline_lines(report["pipeline"], report["dp_world_size"])
    if report.get("moe"):
        lines[2:2] = _moe_lines(report["moe"])
    if report.get("autoep"):
        lines[2:2] = _autoep_lines(report["autoep"])
    adam = report.get("optimizer_family") in (None, "adam")
    for group in report["param_groups"]:
        hyper = group["hyperparameters"]
        step = group["step"] if group["step"] is not None else "-"
        head = f"  group {group['index']}: {group['num_params']} params, {_fmt_int(group['numel'])} elements, "
        if adam:
            settings = (
                f"lr={hyper['lr']:g} weight_decay={hyper['weight_decay']:g} betas={tuple(hyper['betas'])} "
                f"eps={hyper['eps']:g}"
            )
        else:  # the optimizer's own settings, not Adam's names
            settings = " ".join(f"{k}={v}" for k, v in group["settings"].items() if k not in _SWITCHES)
        lines.append(f"{head}{settings} step={step}")
        lines.append(f"    state: {', '.join(group['state_keys']) or '(none yet)'}")
    if report["tied"]:
        lines.append("  tied: " + ", ".join(f"{alias} -> {owner}" for alias, owner in report["tied"].items()))
    if report["buffers"]:
        lines.append("  buffers: " + ", ".join(report["buffers"]))
    rules = report.get("tensor_parallel") or {}
    if rules:
        kinds = [r["kind"] for r in rules.values()]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("split", "replicated", "average") if k in kinds)
        lines.append(f"  tensor parallel: shapes are full (merged); rules for {len(rules)} parameters: {counts}")
    for warning in report["warnings"]:
        lines.append(f"  warning: {warning}")
    header = ("name", "shape", "numel", "dtype", "group", "frozen", "step") + (("tp",) if rules else ())
    rows = [
        (
            p["name"],
            "x".join(map(str, p["shape"])) or "scalar",
            _fmt_int(p["numel"]),
            p["dtype"],
            "-" if p["group"] is None else str(p["group"]),
            "yes" if p["frozen"] else "no",
            "-" if p["step"] is None else str(p["step"]),
        )
        + ((_rule_text(rules.get(p["name"])),) if rules else ())
        for p in report["params"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {2, 4, 6}
    lines.append("")
    for row in [header, *rows]:
        cells = [cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
