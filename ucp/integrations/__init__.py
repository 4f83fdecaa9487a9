"""Hooks into training frameworks that load checkpoints through ucp while a run starts (they import deepspeed)."""

__all__: list[str] = []
