#!/usr/bin/env bash
# The 32B variant of dapo_clip_cov_global.sh: Qwen2.5-32B, per-GPU token budget 20480 [recipe
# 32b_clip_cov.sh]; clip_cov_ratio 2e-4 and the window 1..5 as at 7B [recipe]. Everything else as for 7B.
#   MODEL_PATH=/models/Qwen2.5-32B TRAIN_FILE=... TEST_FILE=... bash examples/dapo_clip_cov_global_32b.sh
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-/path/to/Qwen2.5-32B}
export CLIP_COV_RATIO=${CLIP_COV_RATIO:-0.0002}
export MAX_TOKEN=${MAX_TOKEN:-20480}
exec bash "$(dirname "$0")/dapo_clip_cov_global.sh" "$@"
