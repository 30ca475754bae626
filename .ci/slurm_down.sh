#!/usr/bin/env bash
# Stop the one-node SLURM cluster that .ci/slurm_up.sh started (the same as .ci/slurm_up.sh --stop).
exec "$(dirname "$0")/slurm_up.sh" --stop
