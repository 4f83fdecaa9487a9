"""File I/O: the safe torch-file reader, the one torch-zip writer, atomic output, a worker pool."""

__all__: list[str] = []
