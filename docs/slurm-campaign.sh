#!/bin/bash
# A ninelives fault-injection campaign as a Slurm job array: one shard per
# array task (see docs/campaigns.md).
#
#   sbatch --array=0-15 docs/slurm-campaign.sh
#   ninelives inject merge campaign-$CAMPAIGN/shard-*.json
#
# The array size is the shard count; keep RUNS and SEED the same for every
# task of one campaign.
#SBATCH --job-name=ninelives-inject
#SBATCH --cpus-per-task=2
#SBATCH --mem=4G
#SBATCH --time=02:00:00
#SBATCH --output=slurm-%A_%a.log

set -euo pipefail
NINELIVES=${NINELIVES:-ninelives}
CAMPAIGN=${CAMPAIGN:-register-1vm-microreset}
RUNS=${RUNS:-1000}
SEED=${SEED:-1}
SHARDS=${SLURM_ARRAY_TASK_COUNT:?run as a job array (sbatch --array=0-N)}
INDEX=${SLURM_ARRAY_TASK_ID:?run as a job array}
# Arrays that do not start at 0 (--array=1-16) are shifted to 0-based shards.
INDEX=$((INDEX - ${SLURM_ARRAY_TASK_MIN:-0}))

mkdir -p "campaign-$CAMPAIGN"
"$NINELIVES" inject --fault register --setup 1vm --recovery microreset \
    --runs "$RUNS" --seed "$SEED" --shard "$INDEX/$SHARDS" --jobs 1 --json \
    > "campaign-$CAMPAIGN/shard-$INDEX.json"
