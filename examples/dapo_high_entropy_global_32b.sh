#!/usr/bin/env bash
# The 32B variant of dapo_high_entropy_global.sh: Qwen3-32B-Base, rho 0.2 [paper]. The authors
# publish only the 14B script; the paper trains 32B with the same DAPO settings and a 20k response
# budget (MAX_RESPONSE=29696 for its 29k extension). Everything else as for 14B.
#   MODEL_PATH=/models/Qwen3-32B-Base TRAIN_FILE=... TEST_FILE=... bash examples/dapo_high_entropy_global_32b.sh
set -euo pipefail
export MODEL_PATH=${MODEL_PATH:-/path/to/Qwen3-32B-Base}
export ENTROPY_TOP_RATIO=${ENTROPY_TOP_RATIO:-0.2}
exec bash "$(dirname "$0")/dapo_high_entropy_global.sh" "$@"
