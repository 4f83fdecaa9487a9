"""Build apex's ``amp_C`` extension (the multi-tensor kernels Apex FusedAdam calls) from an apex checkout, alone.

``python gpu/amp_c.py APEX_DIR`` builds it with torch's extension builder for the GPUs in
TORCH_CUDA_ARCH_LIST, and prints the folder holding ``amp_C.so`` (put it on PYTHONPATH). The sources are read
from apex's own setup.py, so they follow the checkout.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def amp_c_sources(apex: Path) -> list[Path]:
    """The sources apex's setup.py lists for its amp_C extension."""
    setup = (apex / "setup.py").read_text()
    found = re.search(r'name="amp_C",\s*sources=\[(.*?)\]', setup, re.S)
    if found is None:
        raise SystemExit(f"{apex}/setup.py: no amp_C extension found")
    return [apex / name for name in re.findall(r'"([^"]+)"', found.group(1))]


def main(argv: list[str]) -> None:
    from torch.utils.cpp_extension import load

    apex = Path(argv[0]).resolve()
    module = load(
        name="amp_C",
        sources=[str(p) for p in amp_c_sources(apex)],
        extra_include_paths=[str(apex / "csrc")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
        verbose=False,
    )
    print(Path(module.__file__).parent)


if __name__ == "__main__":
    main(sys.argv[1:])
