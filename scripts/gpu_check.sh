#!/usr/bin/env bash
# The GPU validation kit: one prepared command that proves the plugin on a real accelerator.
#
#   bash scripts/gpu_check.sh            # on the GPU machine: <= 8 min, writes out/gpu_check.json
#   bash scripts/gpu_check.sh --smoke    # the same code on CPU with tiny sizes (CI): out/gpu_check_smoke.json
#
# Any further arguments go to `python -m benchmarks.gpu_check` (see its --help), e.g. --json PATH.
# Prints a table after each phase and rewrites the JSON after each phase, so a run cut short still
# leaves the phases it finished. Exit status: 0 every check passed, 1 a check failed, 2 bad usage or
# no accelerator, 3 a phase did not finish (error or time budget), 124 killed by the overall timeout.
#
# Environment:
#   PYTHON             interpreter (default: .venv/bin/python if present, else python3)
#   GPU_WHEELS         wheels to install when verl is missing (default .whl, made by scripts/gpu_prepare.sh)
#   GPU_SITE           where they are installed (default /tmp/site)
#   GPU_CHECK_TIMEOUT  hard limit in seconds for the Python run (default 450 full, 330 smoke)
#   OUT                when set (the GPU machine's return folder), the JSON and the log are copied there
#
# On the GPU machine the plugin is not pip-installed, so verl's entry point (group verl.plugins)
# cannot load it: the kit runs from src/ (PYTHONPATH) and loads it through verl's own
# VERL_USE_EXTERNAL_MODULES=verl_klcov_global (plus an explicit import in benchmarks.gpu_check).
# Ray is not installed there either: benchmarks/gpu_stubs/ray stands in for it (see that file).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SMOKE=0
for arg in "$@"; do [ "$arg" = "--smoke" ] && SMOKE=1; done

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=${GPU_WHEELS:-.whl}
SITE=${GPU_SITE:-/tmp/site}
has_module() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

if ! has_module verl; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: verl is not installed for $PYTHON and $WHEELS/ holds no wheels:" \
         "run 'bash scripts/gpu_prepare.sh' on the CPU machine and carry $WHEELS" >&2
    exit 2
  fi
  echo "gpu_check: installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels failed" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! has_module ray; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/benchmarks/gpu_stubs"
fi
export VERL_USE_EXTERNAL_MODULES=verl_klcov_global
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# One process, one rank: NCCL's bootstrap needs no network; loopback avoids picking an interface.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

if [ "$SMOKE" -eq 1 ]; then LIMIT=${GPU_CHECK_TIMEOUT:-330}; JSON=out/gpu_check_smoke.json
else LIMIT=${GPU_CHECK_TIMEOUT:-450}; JSON=out/gpu_check.json; fi
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[$i]}" = "--json" ] && JSON=${args[$((i + 1))]:-$JSON}; done
mkdir -p out "$(dirname "$JSON")"
LOG="${JSON%.json}.log"

# TERM first (the check writes its JSON on the way out), KILL 20 s later.
timeout -k 20 "$LIMIT" "$PYTHON" -m benchmarks.gpu_check "$@" --json "$JSON" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
[ "$status" -eq 124 ] && echo "gpu_check: stopped by the ${LIMIT} s limit; $JSON holds the phases that finished"

if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp -f "$JSON" "$LOG" "$OUT"/ 2>/dev/null && echo "gpu_check: copied $JSON and $LOG to \$OUT"
fi
exit "$status"
