"""Operations over readers and targets: convert, verify, inspect, distributed conversion."""

__all__: list[str] = []
