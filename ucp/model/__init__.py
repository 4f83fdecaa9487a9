"""Pure models: records, options, optimizer flavours, partition and TP maths. No file I/O here."""

__all__: list[str] = []
