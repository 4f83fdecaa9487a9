"""ucp: universal checkpoints for DeepSpeed ZeRO."""
