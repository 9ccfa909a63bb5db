#!/bin/bash
# `roboscale train` or `roboscale rl` as a Ray job on a running Ray cluster (`ray job submit`): the command runs on
# the head node, and its Ray work -- Ray Train's workers, the rollout's env workers and generators -- goes where
# the cluster has room (or where you place it).
#
#   RAY_ADDRESS=http://HEAD:8265 DATASET=/shared/data/drawers OUTPUT_DIR=/shared/runs/pi05 \
#       examples/ray/submit.sh train --steps=2000 --batch_size=64
#   RAY_ADDRESS=http://HEAD:8265 POLICY=/shared/runs/pi05 OUTPUT_DIR=/shared/runs/pi05-rl \
#       examples/ray/submit.sh rl --tasks='[mt10]' --steps=100 --rl.mode=async
#
# What it reads from the environment:
#   RAY_ADDRESS     the head's dashboard (job server), http://HEAD:8265 (required; `ray start --head` prints it)
#   OUTPUT_DIR      --output_dir, on a filesystem every node shares (required); made absolute here, so give the
#                   path as the head sees it. A job submitted again with the same OUTPUT_DIR resumes from its last
#                   checkpoint (--resume=true is passed when OUTPUT_DIR/checkpoints/last exists)
#   DATASET         train: --dataset.root, on the shared filesystem (required for train)
#   POLICY          rl: --policy_path, the supervised run or checkpoint RL starts from (required for rl)
#   WORKERS         train: Ray Train workers (--ray.num_workers, default 2)
#   PLACEMENT       train: --ray.placement_strategy (default SPREAD: one worker per node where there is room)
#   ROLLOUT_RESOURCES  rl: custom Ray resources each env worker and generator asks for, as JSON ('{"sim": 1}'
#                   puts them on the nodes started with `ray start --resources='{"sim": N}'`); default: anywhere
#   ROBOSCALE       the roboscale command on the head node (default: roboscale, on the PATH `ray start` ran with)
#   JOB_ID          the job's submission id (default roboscale-<command>-<time>; `ray job logs JOB_ID`)
# Ray's token: a cluster started with token authentication (RAY_AUTH_MODE=token, as `ray start` sets it up) needs
# RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) here too.
set -euo pipefail

command=${1:?"usage: $0 train|rl [roboscale options...]"}
shift
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard of the head node, http://HEAD:8265}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to a directory on a filesystem every node shares}"
output_dir=$(realpath -m "$OUTPUT_DIR")
args=("--output_dir=$output_dir")
if [ -e "$output_dir/checkpoints/last" ]; then
    args+=("--resume=true")
fi
case "$command" in
    train)
        : "${DATASET:?set DATASET to the root of the dataset, on the shared filesystem}"
        args+=("--dataset.root=$(realpath -m "$DATASET")" "--launcher=ray" "--ray.address=auto"
               "--ray.num_workers=${WORKERS:-2}" "--ray.placement_strategy=${PLACEMENT:-SPREAD}")
        ;;
    rl)
        : "${POLICY:?set POLICY to the supervised run (or checkpoint) RL starts from}"
        args+=("--policy_path=$(realpath -m "$POLICY")" "--rollout.ray_address=auto")
        if [ -n "${ROLLOUT_RESOURCES:-}" ]; then
            args+=("--rollout.ray_resources=$ROLLOUT_RESOURCES")
        fi
        ;;
    *)
        echo "$0: the command is train or rl, not '$command'" >&2
        exit 2
        ;;
esac
# waits for the job and streams its output; exits non-zero when the job fails (ray quotes each argument)
exec ray job submit --address "$RAY_ADDRESS" --submission-id "${JOB_ID:-roboscale-$command-$(date +%Y%m%d-%H%M%S)}" \
    -- "${ROBOSCALE:-roboscale}" "$command" "${args[@]}" "$@"
