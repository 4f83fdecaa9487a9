#!/usr/bin/env bash
# On a CUDA machine, from the repository root with .gpu/ from gpu/prepare.sh beside it, no network needed:
# install the wheels, build apex's amp_C and DeepSpeed's FusedAdam for this GPU, run the gpu-marked tests
# (TESTS, JOBS at a time: every rank is one process on the one GPU), and leave the results in OUT (default
# .gpu/out): pytest.log, junit.xml, versions.txt and gpu-checkpoints.tgz (the small checkpoints the GPU
# wrote, for `UCP_GPU_CHECKPOINTS=... pytest tests/test_gpu_written.py` on a CPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-.gpu/out}
SITE=${SITE:-/tmp/ucp-gpu-site}
mkdir -p "$OUT" "$SITE"
OUT=$(cd "$OUT" && pwd)
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/wheels/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD:$PWD/.gpu/apex:${PYTHONPATH:-}"
# libaio (DeepSpeed's async_io op: FastPersist's writer, NVMe offload) where the image has none: .gpu/aio/root
if [ -d .gpu/aio/root ]; then
    AIO="$PWD/.gpu/aio/root/usr"
    export CPATH="$AIO/include${CPATH:+:$CPATH}" LIBRARY_PATH="$AIO/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$AIO/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ucp-gpu-ext}
export DS_ACCELERATOR=cuda MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || exit 1
fi
# DeepSpeed 0.19.8 reads each entry as numbers: an image's "9.0a" (Hopper's arch-specific target) fails its
# FusedAdam build with "invalid literal for int(): '0a'"; the plain "9.0" builds the same kernels for this use
TORCH_CUDA_ARCH_LIST=$(printf '%s' "$TORCH_CUDA_ARCH_LIST" | sed -E 's/([0-9]+\.[0-9]+)[a-z]/\1/g')
export TORCH_CUDA_ARCH_LIST
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PYTHON" -c 'import sys, torch, deepspeed; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__)'
} 2>&1 | tee "$OUT/versions.txt"
# the two builds are independent: DeepSpeed's FusedAdam builds while apex's amp_C does
"$PYTHON" -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' > "$OUT/fused_adam.log" 2>&1 &
fused=$!
if [ -d .gpu/apex ]; then
    AMP_C=$("$PYTHON" gpu/amp_c.py .gpu/apex 2> "$OUT/amp_c.log" | tail -1) && export PYTHONPATH="$AMP_C:$PYTHONPATH" \
        || { echo "apex's amp_C did not build (see amp_c.log): the Apex cells will skip"; tail -5 "$OUT/amp_c.log"; }
fi
wait "$fused" || { echo "DeepSpeed FusedAdam did not build (see fused_adam.log)"; tail -5 "$OUT/fused_adam.log"; }
mkdir -p /tmp/ucp-gpu-keep
# DEADLINE (seconds, 0 for none): pytest is interrupted then, and still writes its log, junit.xml and the checkpoints
UCP_GPU_KEEP=/tmp/ucp-gpu-keep timeout -s INT "${DEADLINE:-0}" "$PYTHON" -m pytest -m gpu -n "${JOBS:-8}" --dist loadgroup -p no:cacheprovider -q -ra \
    --junitxml "$OUT/junit.xml" ${TESTS:-tests/test_device_flavours.py tests/test_flavors.py tests/test_cuda_modes.py} "$@" 2>&1 | tee "$OUT/pytest.log"
code=${PIPESTATUS[0]}
tar czf "$OUT/gpu-checkpoints.tgz" -C /tmp/ucp-gpu-keep . && du -h "$OUT/gpu-checkpoints.tgz"
exit "$code"
