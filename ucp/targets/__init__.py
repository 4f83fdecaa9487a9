"""Targets: write a reader's state somewhere a training run can use it.

native (per-rank ZeRO files for stock DeepSpeed), engine (a live DeepSpeed engine), torch (a plain
model and optimizer), export (consolidated weights). Each takes any :class:`ucp.model.records.Reader`.
"""

__all__: list[str] = []  # import the target modules themselves: ucp.targets.native, ...
