"""A stand-in rank for launcher tests: ``python -m tests.support.rank_probe MODE``. In ``fail0`` mode rank 0
exits with 3 at once and the others wait as ranks wait for a dead peer; in ``ok`` mode every rank exits 0;
``show`` prints what the rank was given (rank, world, folder, a variable, its threads); ``abort`` dies of
SIGABRT, leaving no exit code of its own."""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    if sys.argv[1] == "fail0" and os.environ["RANK"] == "0":
        sys.exit(3)
    if sys.argv[1] == "fail0":
        time.sleep(300)
    if sys.argv[1] == "show":
        import torch

        print(
            os.environ["RANK"], os.environ["WORLD_SIZE"], os.getcwd(), os.environ.get("PROBE"), torch.get_num_threads()
        )
    if sys.argv[1] == "abort":
        os.abort()
