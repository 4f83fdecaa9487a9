#!/usr/bin/env bash
# Gather, on a machine with a package index, what the GPU tests need on a CUDA machine that has none:
# wheels for that machine's Python (PY, default 3.12) in .gpu/wheels, and an apex checkout in .gpu/apex
# (APEX_SRC: a local checkout or a git URL). .gpu/ is git-ignored; copy it along with the repository.
# The CUDA machine must already have torch (CUDA build), ninja, numpy, pyyaml, psutil, msgpack, py-cpuinfo,
# einops, tqdm, packaging, pytest and pytest-xdist; DeepSpeed and its pydantic/hjson are brought here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
DEEPSPEED=${DEEPSPEED:-0.19.8}
mkdir -p .gpu/wheels
# DeepSpeed is published as an sdist: a pure-Python wheel of it, its ops built just in time where they run
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation -w .gpu/wheels "deepspeed==$DEEPSPEED"
# DeepSpeed's needs that a CUDA image with torch usually lacks, resolved together for that Python
pip download -q --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .gpu/wheels hjson "pydantic>=2"
if [ ! -d .gpu/apex ]; then
    [ -n "${APEX_SRC:-}" ] || { echo "set APEX_SRC to an apex checkout (or git URL) to test Apex FusedAdam" >&2; exit 2; }
    if [ -d "$APEX_SRC/.git" ] || [ -f "$APEX_SRC/setup.py" ]; then cp -r "$APEX_SRC" .gpu/apex; else git clone -q --depth 1 "$APEX_SRC" .gpu/apex; fi
    rm -rf .gpu/apex/.git
fi
# libaio for DeepSpeed's async_io op (FastPersist), unpacked: CUDA images often lack it (run.sh points gcc at it)
if [ ! -d .gpu/aio/root ] && command -v apt-get > /dev/null; then
    mkdir -p .gpu/aio && (cd .gpu/aio && apt-get download -q libaio1 libaio-dev 2> /dev/null \
        && for deb in *.deb; do dpkg -x "$deb" root; done; rm -f ./*.deb) || echo "libaio not fetched: FastPersist will skip" >&2
fi
du -sh .gpu/wheels .gpu/apex
