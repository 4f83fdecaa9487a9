"""The argument parser: every verb's flags, and the verb function each one runs (``args.func``).

Importing it imports no torch: the verb modules import what they need inside their functions."""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn

from ucp import DISTRIBUTION, __version__
from ucp.cli.restore import cmd_reshard, cmd_restore
from ucp.cli.verbs import cmd_demo, cmd_diff, cmd_export, cmd_inspect, cmd_migrate, cmd_to_universal, cmd_verify
from ucp.model.option_table import DCP_OPTIMIZER_NAMES, FLAVOUR_NAMES, FORMAT_NAMES, OPTIONS, Option

__all__ = ["DCP_OPTIMIZER_NAMES", "FLAVOUR_NAMES", "build_parser"]


#: the subparsers of the verbs, which each verb's function adds its parser to
_Verbs = argparse._SubParsersAction


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line that says where the help is (not the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _log_flags(p: argparse.ArgumentParser, *, top: bool) -> None:
    """-q, -v and --debug, accepted before the verb and after it (``ucp -q diff A B`` and ``ucp diff A B -q``)."""
    default: Any = False if top else argparse.SUPPRESS
    p.add_argument("--debug", action="store_true", default=default, help="show tracebacks and debug logging")
    p.add_argument("-v", "--verbose", action="store_true", default=default, help="log progress and each phase's time")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="print nothing but errors (no result line, notes, report or progress bars; the exit code tells)",
    )


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _output_flags(p: argparse.ArgumentParser, *, fsync: bool = False) -> None:
    """The flags of every verb that writes: what may be replaced, the space check, durability."""
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and ucp wrote it")
    p.add_argument(
        "--overwrite-foreign",
        action="store_true",
        help="with --overwrite: replace OUT even when ucp did not write it (never an input)",
    )
    p.add_argument(
        "--no-space-check",
        action="store_true",
        help="write even when the file system seems to lack room for the output",
    )
    if fsync:
        p.add_argument("--fsync", action="store_true", help="flush OUT to disk before publishing it (power-loss safe)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")


def _option_flag(p: argparse.ArgumentParser, option: Option) -> None:
    """One declared option as a flag, read as its kind says."""
    how: dict[str, Any] = {"help": option.help}
    if option.kind == "positive":
        how.update(type=_positive, default=option.unset)
    elif option.kind == "choice":
        how.update(type=type(option.choices[0]), choices=option.choices)
    elif option.kind == "tristate":
        how.update(action=argparse.BooleanOptionalAction, default=None)
    elif option.kind == "list":
        how.update(action="append")
    elif option.kind == "flag":
        how.update(action="store_true")
    else:  # step, tag, text: read as given, checked by the target
        how.update(default=option.unset)
    if option.metavar is not None:
        how["metavar"] = option.metavar
    p.add_argument(option.flag, **how)


def _new_run_flags(p: argparse.ArgumentParser, *, dcp: bool) -> None:
    """The new run's layout and optimizer (every declared option; ``dcp``: a DCP output's too), the workers, then
    the output flags."""
    for option in OPTIONS:
        if dcp or option.targets != {"dcp"}:
            _option_flag(p, option)
    p.add_argument(
        "--workers",
        type=_positive,
        help="the most threads reading and writing (default: the CPUs ucp may use; one for a checkpoint of small tensors)",
    )
    _output_flags(p, fsync=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ucp",
        description="Move a training checkpoint to another GPU count, ZeRO stage, optimizer, layout or framework.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"ucp {__version__} (distribution {DISTRIBUTION})")
    _log_flags(parser, top=True)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in (_to_universal, _restore, _reshard, _inspect, _verify, _diff, _export, _migrate, _demo):
        add(verbs)
    for sub in verbs.choices.values():
        sub.allow_abbrev = False  # "--over" must not pass for --overwrite
        _log_flags(sub, top=False)
    return parser


def _to_universal(verbs: _Verbs) -> None:
    """``ucp to-universal SRC OUT``: a checkpoint of any source format to a universal directory."""
    p = verbs.add_parser("to-universal", help="DeepSpeed ZeRO or DCP checkpoint -> universal directory")
    p.add_argument("src", help="checkpoint folder (holding 'latest'), a tag folder, or a DCP folder (.metadata)")
    p.add_argument("out", help="universal directory to create")
    p.add_argument("--tag", help="tag folder to read (default: the one 'latest' names)")
    p.add_argument("--optimizer", choices=FLAVOUR_NAMES, help="the source's optimizer, when detection cannot tell")
    p.add_argument(
        "--workers",
        type=_positive,
        help="the most threads (default: CPU count, at most 8; one for a checkpoint of small tensors)",
    )
    _output_flags(p, fsync=True)
    p.add_argument(
        "--frozen",
        nargs="+",
        metavar="NAME",
        help="these are frozen parameters: a DCP source's one-rank save cannot tell them from buffers, a stage-0 "
        "checkpoint from trained parameters of the same shape",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="split the work across torch.distributed ranks (launch with torchrun)",
    )
    p.set_defaults(func=cmd_to_universal)


def _restore(verbs: _Verbs) -> None:
    """``ucp restore UNIVERSAL OUT``: a native checkpoint (or DCP) for the new run, every restore option a flag."""
    p = verbs.add_parser("restore", help="universal directory -> native ZeRO checkpoint for a DP size, or DCP")
    p.add_argument(
        "universal",
        help="universal directory (or a DeepSpeed or DCP checkpoint); a Trainer checkpoint-N or Accelerate "
        "save_state folder gives a whole folder of the same kind for the new size",
    )
    p.add_argument("out", help="checkpoint folder to create (gets 'latest' and the tag folder)")
    p.add_argument(
        "--format",
        choices=FORMAT_NAMES,
        default="deepspeed",
        help="deepspeed (default): a native ZeRO checkpoint; dcp: a torch.distributed.checkpoint folder for FSDP2; "
        "megatron: a Megatron-Core torch_dist checkpoint",
    )
    _new_run_flags(p, dcp=True)
    p.set_defaults(func=cmd_restore)


def _reshard(verbs: _Verbs) -> None:
    """``ucp reshard SRC OUT``: DeepSpeed to DeepSpeed at another layout, with no universal copy between."""
    p = verbs.add_parser(
        "reshard", help="DeepSpeed checkpoint -> DeepSpeed checkpoint for another DP/stage/TP, no universal copy"
    )
    p.add_argument("universal", metavar="src", help="DeepSpeed checkpoint (or any source restore reads)")
    p.add_argument("out", help="checkpoint folder to create (gets 'latest' and the tag folder)")
    _new_run_flags(p, dcp=False)
    p.set_defaults(func=cmd_reshard, format="deepspeed", dcp_layout=None)


def _inspect(verbs: _Verbs) -> None:
    """``ucp inspect PATH``: a checkpoint's facts."""
    p = verbs.add_parser("inspect", help="summarize a DeepSpeed checkpoint or universal directory")
    p.add_argument("path", help="DeepSpeed checkpoint, universal directory, DCP or Hugging Face folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one `latest` names)")
    p.add_argument("--optimizer", choices=FLAVOUR_NAMES, help="the optimizer flavour, when detection cannot tell")
    p.set_defaults(func=cmd_inspect)


def _verify(verbs: _Verbs) -> None:
    """``ucp verify SOURCE [UNIVERSAL]``: a universal directory against its source, or a model against a checkpoint."""
    p = verbs.add_parser(
        "verify", help="check a universal directory against its source, or a model against a checkpoint"
    )
    p.add_argument("source", help="DeepSpeed checkpoint (or universal directory with --model)")
    p.add_argument("universal", nargs="?", help="universal directory to compare bit for bit")
    p.add_argument("--model", help="MODULE:CALLABLE building the model whose names/shapes/order to check")
    p.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one `latest` names)")
    p.add_argument("--json", action="store_true", help="print one JSON object (ok, message, what was compared)")
    p.set_defaults(func=cmd_verify)


def _diff(verbs: _Verbs) -> None:
    """``ucp diff A B``: two checkpoints of any formats, parameter by parameter."""
    p = verbs.add_parser(
        "diff", help="compare two checkpoints of any format, parameter by parameter and state key by state key"
    )
    p.add_argument("a", help="checkpoint A (DeepSpeed ZeRO at any DP/TP, universal, DCP, Hugging Face folder)")
    p.add_argument("b", help="checkpoint B, any format too")
    p.add_argument(
        "--atol", type=_non_negative, default=0.0, help="largest difference counted as equal (default 0: bit for bit)"
    )
    p.add_argument("--tag-a", help="DeepSpeed tag to read in A (default: latest)")
    p.add_argument("--tag-b", help="DeepSpeed tag to read in B (default: latest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot", metavar="FILE", help="also draw each parameter's differences into FILE (.png, .svg, .pdf; matplotlib)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the --plot FILE if it exists")
    p.set_defaults(func=cmd_diff)


def _export(verbs: _Verbs) -> None:
    """``ucp export SRC OUT``: consolidated weights."""
    p = verbs.add_parser("export", help="consolidated weights (safetensors or torch)")
    p.add_argument("src", help="universal directory or DeepSpeed checkpoint")
    p.add_argument("out", help="output file (model.safetensors / pytorch_model.bin) or folder when sharded")
    p.add_argument(
        "--format", choices=("safetensors", "torch"), default="safetensors", help="file format (default safetensors)"
    )
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: the model's dtype")
    p.add_argument("--max-shard-size", default="5GB", help="shard above this size, e.g. 500MB, 5GB (default 5GB)")
    p.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one `latest` names)")
    _output_flags(p)
    p.set_defaults(func=cmd_export)


def _migrate(verbs: _Verbs) -> None:
    """``ucp migrate CONFIG``: a YAML migration."""
    p = verbs.add_parser("migrate", help="run a YAML migration (read, transform, restore, export)")
    p.add_argument("config", help="migration YAML")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    _output_flags(p)
    p.set_defaults(func=cmd_migrate)


def _demo(verbs: _Verbs) -> None:
    """``ucp demo``: the end-to-end demonstration on CPU ranks."""
    p = verbs.add_parser("demo", help="train a tiny model with real DeepSpeed, convert, restore at another DP, compare")
    p.add_argument(
        "--workdir",
        default="ucp-demo",
        help="folder for the demo's checkpoints: new, empty, or one an earlier demo made (default ./ucp-demo)",
    )
    p.add_argument("--source-dp", type=_positive, default=4, help="DP size of the training run saved (default 4)")
    p.add_argument("--target-dp", type=_positive, default=2, help="DP size the run resumes at (default 2)")
    p.set_defaults(func=cmd_demo)
