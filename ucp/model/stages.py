"""Which layers each pipeline stage holds: DeepSpeed's ``PipelineModule`` partition methods as pure
functions of the layer count or per-layer weights, so a target can cut a new PP size without building
the model. No I/O, no torch.

``parts`` is what ``PipelineModule.parts`` holds: stage ``s`` runs layers ``parts[s] .. parts[s+1]-1``.
``uniform`` gives every stage ``n // m`` layers and the first ``n % m`` stages one more (fewer layers than
stages: one each, the rest none). ``parameters`` weighs each layer by its trainable elements and takes
the contiguous cut whose heaviest and lightest stages differ least (the linear-partition dynamic
programme DeepSpeed 0.19.8 runs; of equally good cuts, the one whose last stage starts latest, then the
same rule stage by stage backwards), so the parts equal DeepSpeed's for the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["uniform_parts", "balanced_parts", "METHODS"]

#: the partition methods ucp can reproduce without the model's layer classes
METHODS = ("uniform", "parameters")


def uniform_parts(num_layers: int, num_stages: int) -> list[int]:
    """``partition_method="uniform"``: stage boundaries for ``num_layers`` layers on ``num_stages`` stages."""
    if num_layers <= num_stages:
        return [min(stage, num_layers) for stage in range(num_stages + 1)]
    chunk, extra = divmod(num_layers, num_stages)
    return [stage * chunk + min(stage, extra) for stage in range(num_stages + 1)]


def balanced_parts(weights: Sequence[int], num_stages: int) -> list[int]:
    """``partition_method="parameters"`` (or any per-layer weights): the contiguous cut into
    ``num_stages`` non-empty stages minimising (heaviest stage - lightest stage)."""
    n, m = len(weights), num_stages
    if n <= m:
        return uniform_parts(n, m)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    # best[i][j]: (cost, heaviest, lightest, start of the last stage) of the first i layers on j stages
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    heavy = [[inf] * (m + 1) for _ in range(n + 1)]
    light = [[inf] * (m + 1) for _ in range(n + 1)]
    start = [[0] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = heavy[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                hi, lo = max(heavy[k][j - 1], last), min(light[k][j - 1], last)
                if cost[i][j] >= hi - lo:  # ties go to the later start, as DeepSpeed's loop does
                    cost[i][j], heavy[i][j], light[i][j], start[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(start[parts[-1]][j])
    return parts[::-1]
