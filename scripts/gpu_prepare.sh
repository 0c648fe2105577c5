#!/usr/bin/env bash
# Prepares, on this CPU machine, what scripts/gpu_check.sh needs on the GPU machine.
#
#   bash scripts/gpu_prepare.sh             # .whl/: the cp312 wheels the GPU machine lacks, size-checked
#   bash scripts/gpu_prepare.sh --rehearse  # also rehearse the device here (see below) and run the smoke in it
#
# The GPU machine (Python 3.12, torch 2.11 CUDA 13, transformers 5.17, accelerate, peft, numpy,
# pyarrow, pandas, xxhash, pillow, ...) has no verl and no internet. .whl/ (git-ignored) receives
# exactly the wheels it lacks on the path gpu_check.sh runs, found by importing that path in a
# Python that has only the device's packages (--rehearse):
#   verl, tensordict (+ pyvers, orjson), omegaconf (+ antlr4-python3-runtime), codetiming,
#   datasets (+ dill, multiprocess; verl's FSDP engine imports verl.utils.dataset).
# Not carried: ray (~70 MB wheel; benchmarks/gpu_stubs/ray stands in for it, see there),
# hydra-core (not imported on this path). antlr4-python3-runtime 4.9.3 exists only as an sdist:
# it is built here into a pure-Python wheel.
#
# Carry .whl to the device (run tool: carry [".whl"]); gpu_check.sh installs it there with
# `pip install --no-index --no-deps --target`. Everything that travels (the working tree plus
# .whl) must fit 64 MiB; this script fails when it would exceed BUDGET_MIB (default 48).
#
# --rehearse: builds .venv-device-rehearsal/ (Python 3.11 here; torch 2.13 CPU from the local
# wheel) holding only packages the device has (transformers 5.17.0 and its neighbours; anything
# pip pulls in that the device lacks is removed again), downloads the cp311 builds of the same
# wheels into .whl-rehearsal/, and runs `bash scripts/gpu_check.sh --smoke` with that Python:
# gpu_check.sh installs .whl-rehearsal exactly as it installs .whl on the device.
set -euo pipefail
cd "$(dirname "$0")/.."

REHEARSE=0
for arg in "$@"; do
  case "$arg" in
    --rehearse) REHEARSE=1 ;;
    *) echo "usage: bash scripts/gpu_prepare.sh [--rehearse]" >&2; exit 2 ;;
  esac
done

BUDGET_MIB=${BUDGET_MIB:-48}
# One version of each (two versions of a name stop the device's install).
WHEELS=(
  verl==0.9.1
  tensordict==0.10.0
  pyvers==0.1.0
  orjson==3.13.0
  omegaconf==2.3.1
  codetiming==1.4.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
)
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

quiet_pip() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

# download_wheels DIR PYVER: the wheel set for CPython PYVER (e.g. 312) into a fresh DIR.
download_wheels() {
  local dir=$1 pyver=$2 platform_args=()
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  rm -rf "$dir" && mkdir -p "$dir"
  quiet_pip python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${pyver:0:1}.${pyver:1}" \
    --implementation cp "${platform_args[@]}" -d "$dir" "${WHEELS[@]}"
  quiet_pip python3 -m pip wheel -q --no-deps -w "$dir" "${SDIST_ONLY[@]}"
  local expected=$(( ${#WHEELS[@]} + ${#SDIST_ONLY[@]} )) found
  found=$(ls "$dir"/*.whl | wc -l)
  if [ "$found" -ne "$expected" ]; then
    echo "gpu_prepare: expected $expected wheels in $dir, found $found" >&2; ls -l "$dir" >&2; exit 1
  fi
}

download_wheels .whl 312
echo "wheels for the GPU machine (cp312, manylinux x86_64) in .whl/:"
ls -l .whl/*.whl | awk '{printf "  %9d  %s\n", $5, $9}'

# What travels: tracked and untracked-not-ignored files (shared/ included if present) plus .whl.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
wheel_bytes=$(stat -c %s .whl/*.whl | awk '{s += $1} END {print s + 0}')
python3 - "$tree_bytes" "$wheel_bytes" "$BUDGET_MIB" <<'PY'
import sys
tree, wheels, budget = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
mib = 1 << 20
total = tree + wheels
print(f"travels: working tree {tree / mib:.2f} MiB + wheels {wheels / mib:.2f} MiB = {total / mib:.2f} MiB "
      f"(limit 64 MiB, this script's budget {budget:g} MiB)")
if total > budget * mib:
    sys.exit(f"gpu_prepare: {total / mib:.2f} MiB exceeds the budget of {budget:g} MiB: drop a wheel or shrink the tree")
PY

if [ "$REHEARSE" -eq 1 ]; then
  VENV=.venv-device-rehearsal
  [ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
  # The device's own packages that this path imports (versions as seen there where known; numpy 2.5
  # needs Python 3.12, so 2.4.6 here). torch: the local CPU wheel (constraints.txt).
  quiet_pip "$VENV/bin/python" -m pip install -q torch==2.13.0 transformers==5.17.0 tokenizers==0.23.2 \
    accelerate==1.15.0 peft numpy==2.4.6 safetensors==0.8.0 huggingface-hub==1.33.0 pyyaml packaging psutil \
    pyarrow pandas cloudpickle msgpack pytest hypothesis requests tqdm regex xxhash pillow
  # Pulled in by pip here, absent from the device's package list: remove, so an import of them fails here too.
  quiet_pip "$VENV/bin/python" -m pip uninstall -q -y pydantic pydantic-core annotated-types typing-inspection tzdata
  for name in verl tensordict omegaconf hydra ray datasets; do
    if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$name') is None)"; then
      echo "gpu_prepare: $VENV has $name installed; the rehearsal needs a venv without it (rm -r $VENV)" >&2; exit 1
    fi
  done
  download_wheels .whl-rehearsal 311
  rm -rf "$VENV/site"
  echo "rehearsal: $VENV ($("$VENV/bin/python" --version)), wheels from .whl-rehearsal/, running the smoke"
  started=$(date +%s)
  PYTHON="$VENV/bin/python" GPU_WHEELS=.whl-rehearsal GPU_SITE="$VENV/site" bash scripts/gpu_check.sh --smoke \
    --json out/gpu_check_rehearsal.json
  echo "rehearsal ok in $(( $(date +%s) - started )) s: out/gpu_check_rehearsal.json"
fi
