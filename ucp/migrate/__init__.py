"""``ucp migrate CONFIG.yaml``: one YAML file -> a checked plan -> the calls that read, transform, restore, export.

Call order: :func:`load_config` parses the YAML into a :class:`MigrationConfig` (unknown keys,
types and values: every problem at once, each with its key path and line);
:func:`plan_migration` opens the source's facts and checks what only the checkpoint can tell
(renames that collide, drops that empty the model, a ZeRO-3 layout that cannot hold a reset, outputs
that exist) and returns a :class:`MigrationPlan` without writing anything; :meth:`MigrationPlan.describe`
is the ``--dry-run`` output and :func:`execute` does the work: source -> transforms -> universal
(if asked) -> native target (if asked) -> exports. :func:`run_migration` is all of it, for the CLI.

Relative paths in a config file resolve against the folder that holds the file.
"""

from ucp.migrate.issues import Issue, MigrationConfigError
from ucp.migrate.plan import MigrationPlan, plan_migration
from ucp.migrate.run import execute, run_migration
from ucp.migrate.schema import (
    ExportConfig,
    MigrationConfig,
    RenameConfig,
    ResetConfig,
    TargetConfig,
    TensorParallelConfig,
    TpRuleConfig,
    TransformConfig,
)
from ucp.migrate.yaml_file import load_config, parse_config

__all__ = [
    "MigrationConfig",
    "TransformConfig",
    "RenameConfig",
    "ResetConfig",
    "TargetConfig",
    "ExportConfig",
    "TensorParallelConfig",
    "TpRuleConfig",
    "Issue",
    "MigrationConfigError",
    "MigrationPlan",
    "load_config",
    "parse_config",
    "plan_migration",
    "execute",
    "run_migration",
]
