"""File I/O: the safe torch-file reader, the one torch-zip writer, atomic output, the output guard, signals, a worker pool."""

__all__: list[str] = []
