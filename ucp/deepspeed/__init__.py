"""The one owner of DeepSpeed's on-disk layout: file names, field names and checks, and the dicts
targets build. Nothing here imports deepspeed itself."""

__all__: list[str] = []
