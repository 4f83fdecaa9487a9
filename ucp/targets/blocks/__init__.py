"""Flat ZeRO rank buffers filled from per-parameter state: what the native and live-engine targets share.

Call order: a target builds :class:`~ucp.targets.blocks.common.RankBuffers` for the ranks it
writes, fills them with one stage module's ``fill_*`` (each parameter read once, its slices read
straight into place), settles one step per flat tensor, then hands the buffers to
:mod:`ucp.deepspeed.states` to become the dict DeepSpeed saves and loads.
"""

__all__: list[str] = []
