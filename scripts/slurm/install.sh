#!/usr/bin/env bash
# Installs Debian's slurm-wlm and munge for the single-node SLURM test (tests/test_sweep_slurm.py).
# It runs as part of `make test`: where the tools are already there it does nothing, and where
# it cannot install them (not root, no apt-get) it says so and leaves the test to skip.
set -uo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/slurm/install.sh: slurm-wlm is not installed and cannot be (needs root and" \
        "apt-get); the SLURM test will skip" >&2
    exit 0
fi
echo "scripts/slurm/install.sh: installing slurm-wlm and munge with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
    >/tmp/lmuscale-slurm-install.log 2>&1; then
    echo "scripts/slurm/install.sh: apt-get failed (log: /tmp/lmuscale-slurm-install.log);" \
        "the SLURM test will skip" >&2
    tail -5 /tmp/lmuscale-slurm-install.log >&2
fi
exit 0
