#!/usr/bin/env bash
# A short GPU session's measurements, what matters most first, ended on time.
#
#   bash benchmarks/gpu_session.sh [SECONDS [gpu.py options ...]]
#
# For a GPU lent for minutes, not hours: gpu.py runs the parts below in this order and starts
# none after SECONDS (default 420; give the command about two minutes more, since a part that
# has started runs to its end). Each part, and each model of a train part, is in the JSON as
# soon as it is done, so a run stopped part-way keeps what finished.
#
# 1. train/lmu, train/transformer at 1M and 55k: the paper step, 512 x 1024 tokens in bf16,
#    in 8 micro-batches of 64 (--microbatches 8: no planning compiles), with MFU;
# 2. profile: one 64-sequence micro-batch of lmu-1M and transformer-1M traced, top operations;
# 3. block, loss: the LMU block and the cross-entropy, the XLA paths against the Pallas kernels;
# 4. attention, the other families' train parts, long, precision.
#
# Writes into $OUT (default benchmarks/results): gpu-<device>.json, gpu.log, device.txt (the
# GPU and JAX it saw) and, when under 16 MB, the two profiles' Perfetto traces. A machine
# without network access that has JAX, flax, optax, orbax, scipy, matplotlib, tiktoken, pyarrow
# and tqdm but not this project's other dependencies gets them from .whl/ (`make
# offline-wheels` here fills it); the project itself is read from src/, not installed.
# Options after SECONDS go to gpu.py, and a later --only or --sizes replaces the ones here.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:-420}
shift $(($# > 0 ? 1 : 0))
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH=$site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi || true
    "$python" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} >"$out/device.txt" 2>&1

started=$(mktemp)  # traces older than this are an earlier run's
"$python" benchmarks/gpu.py --time-budget "$budget" --out-dir "$out" \
    --sizes 1M 55k --microbatches 8 \
    --only train/lmu train/transformer profile block loss attention 'train/*' long precision \
    "$@" 2>&1 | tee "$out/gpu.log"
status=${PIPESTATUS[0]}

for model in lmu-1M transformer-1M; do
    find benchmarks/results/profile-*/"$model" -name perfetto_trace.json.gz -newer "$started" \
        -size -15M -exec cp {} "$out/profile-$model.json.gz" \; 2>/dev/null
done
rm -f "$started"
exit "$status"
