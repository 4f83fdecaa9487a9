"""The pieces of benchmarks/bench_convert.py, split by job; the script stays the one entry point.

Nothing in this package imports torch, deepspeed or ``ucp``: every child the benchmark starts inherits
this process's peak RSS into its own ``ru_maxrss``, so the parent has to stay light (see common.py).
"""
