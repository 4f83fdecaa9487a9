"""Real DeepSpeed on local CPU ranks: the demo, the tests and the benchmarks all run through here.

Nothing in this subpackage is imported by a conversion; it exists so that every checkpoint ucp is
tested against is written by DeepSpeed itself (gloo, ``DS_ACCELERATOR=cpu``, N local processes).
"""

from ucp.harness.launch import RankFailure, run_ranks
from ucp.harness.spec import LoadSpec, ModelSpec, RunSpec

__all__ = ["LoadSpec", "ModelSpec", "RankFailure", "RunSpec", "run_ranks"]
