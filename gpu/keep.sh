#!/usr/bin/env bash
# Make tests/data/gpu-written.tgz, the GPU-written checkpoints CI reads on CPU, from gpu/run.sh's outputs:
#   gpu/keep.sh OUT1/gpu-checkpoints.tgz [OUT2/gpu-checkpoints.tgz ...]
# Later archives win where runs share a name (a rerun of some cells). DeepSpeed's zero_to_*.py copies in each
# checkpoint folder and the fixture cache's DONE markers are left out; the archive is reproducible (sorted names,
# fixed owner and time), so an unchanged set gives the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -ge 1 ] || { echo "usage: gpu/keep.sh GPU_CHECKPOINTS.tgz..." >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for archive in "$@"; do
    tar xzf "$archive" -C "$work"
done
find "$work" \( -name 'zero_to_*.py' -o -name DONE \) -delete
tar czf tests/data/gpu-written.tgz --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00Z' -C "$work" .
du -h tests/data/gpu-written.tgz
