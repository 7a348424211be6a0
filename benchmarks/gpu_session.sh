#!/usr/bin/env bash
# A short GPU session's measurements, what matters most first, ended on time.
#
#   bash benchmarks/gpu_session.sh [SECONDS [gpu.py options ...]]
#
# For a GPU lent for minutes, not hours. benchmarks/gpu.py runs these groups of parts in this
# order, each group in a process of its own (a part that breaks its process, such as a kernel's
# first run on this GPU, leaves the later groups to run), and none is started after SECONDS
# (default 420; give the command about two minutes more, since a part that has started runs to
# its end):
#
# 0. flash: the flash loss's kernels at the paper's shapes (64 x 1024 tokens, d = 48 and 204,
#    bf16) against XLA's path, values and gradients, and their times; then train/lmu and
#    train/transformer at 1M with them (--loss-impl flash): the kernels no GPU has run yet;
# 1. train/lmu, train/transformer, train/lmu_g at 1M and 55k: the paper step, 512 x 1024
#    tokens in bf16, in 8 micro-batches of 64 (--microbatches 8: no planning compiles), with
#    MFU, as committed (the dry run's estimates of the paper grid read these rows);
# 2. loss_tiles: each fused loss kernel under a grid of launches for at most 180 s, then the
#    whole loss in both forms under the default and the fastest launches, each also with d
#    held in parts (split width): the kernels are most of a micro-batch's time;
# 3. train/lmu at 1M with the loss in the form and launches that group 2 timed fastest
#    (--tuned-loss; its row says which), so one session measures the step the tuning gives;
# 4. profile: one 64-sequence micro-batch of lmu-1M and transformer-1M traced, then of lmu-1M
#    with its chunk products in the order the layers use off a GPU (steps-last);
# 5. block: one lmu-1M block, the FFT and the XLA chunked path as resolved and in each
#    layout, and through the LMU layer's kernels (--block-impls and --block-dtypes after
#    SECONDS pick fewer);
# 6. loss (the cross-entropy alone, XLA's path and the kernels at d = 48 and 204), attention,
#    the other families' train parts (sru, sru_pp, lstm), long, precision;
# 7. xla_options: the profile's micro-batch steps under each of XLA's GPU options, if time is
#    left (the command's own time limit may stop it; the groups before are kept).
#
# Each part, and each model of a train part, is in the JSON as soon as it is done. Writes into
# $OUT (default benchmarks/results): gpu-<device>.json, gpu.log, device.txt (the GPU and JAX
# it saw) and each profile's Perfetto trace and optimized program, profile-<label>.json.gz and
# hlo-<label>.txt.gz, when under 15 MB. A machine without network access whose Python has
# JAX, flax, optax, orbax, scipy, matplotlib, tiktoken, pyarrow and tqdm but not this
# project's other dependencies gets them from $WHEELS (default .whl/, which
# `make offline-wheels` fills); the project is read from src/, not
# installed. $PYTHON is the Python (default python3). Options after SECONDS go to every gpu.py
# run: not --only, --out or --families (each group names its parts). The JSON's not_started
# lists what the budget left out, in every group.
set -uo pipefail
SECONDS=0 # the budget counts from here: installing, starting the GPU and JAX included
cd "$(dirname "$0")/.."
budget=${1:-420}
shift $(($# > 0 ? 1 : 0))
if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "gpu_session.sh: SECONDS must be a whole number of seconds, got '$budget'" >&2
    exit 2
fi
options=("$@")
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
: >"$out/gpu.log"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$scratch/site" "$wheels"/*.whl || exit 1
    export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi || true
    "$python" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} >"$out/device.txt" 2>&1

touch "$scratch/started" # profiles' traces older than this are an earlier run's
session="session-$(date +%s)-$$"
status=0

run() { # gpu.py on the parts named, with what is left of the budget (once spent, the JSON
    # lists them as not started); options of this group's own come first, ended by --
    local own=()
    if [[ " $* " == *" -- "* ]]; then
        while [ "$1" != -- ]; do
            own+=("$1")
            shift
        done
        shift
    fi
    local left=$((budget - SECONDS))
    [ "$left" -gt 0 ] || left=0.001
    "$python" benchmarks/gpu.py --time-budget "$left" --session "$session" --out-dir "$out" \
        --sizes 1M 55k --microbatches 8 ${options[@]+"${options[@]}"} ${own[@]+"${own[@]}"} \
        --only "$@" 2>&1 | tee -a "$out/gpu.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

traces() { # each profile's Perfetto trace and compiled program into $OUT, where under 15 MB:
    # benchmarks/results/profile-<device>/<label>/.../perfetto_trace.json.gz as
    # profile-<label>.json.gz, and <label>/compiled_hlo.txt.gz as hlo-<label>.txt.gz
    local file label
    while IFS= read -r file; do
        label=${file#benchmarks/results/profile-*/}
        label=${label%%/*}
        case $file in
        *.json.gz) cp "$file" "$out/profile-$label.json.gz" ;;
        *) cp "$file" "$out/hlo-$label.txt.gz" ;;
        esac
    done < <(find benchmarks/results/profile-* \( -name perfetto_trace.json.gz \
        -o -name compiled_hlo.txt.gz \) -newer "$scratch/started" -size -15000000c 2>/dev/null)
}

run flash
run --sizes 1M --loss-impl flash -- train/lmu train/transformer
run -- train/lmu train/transformer train/lmu_g
run --tiles-seconds 180 -- loss_tiles
run --sizes 1M --loss-impl pallas --tuned-loss -- train/lmu
run profile
traces # at once: a later group that the command's time limit stops cannot lose them
run block
run loss attention 'train/sru*' train/lstm long precision
run xla_options
exit "$status"
