#!/usr/bin/env bash
# Creates a virtual environment at the repository root (if missing) and installs the plugin with its
# test dependencies, pinned per verl version (CPU torch 2.13.0 everywhere). Safe to run again.
#
#   bash scripts/setup.sh                 .venv/              verl 0.9.1, pins: constraints.txt
#   bash scripts/setup.sh --verl 0.8.0    .venv-verl-0.8.0/   verl 0.8.0, pins: constraints-verl-0.8.0.txt
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

VERL_VERSION=""
while [ $# -gt 0 ]; do
  case "$1" in
    --verl) VERL_VERSION=${2:?"--verl needs a version, e.g. --verl 0.8.0"}; shift 2 ;;
    --verl=*) VERL_VERSION=${1#--verl=}; shift ;;
    *) echo "usage: bash scripts/setup.sh [--verl VERSION]   (got: $1)" >&2; exit 2 ;;
  esac
done
if [ -z "$VERL_VERSION" ]; then
  VENV=.venv
  CONSTRAINTS=constraints.txt
else
  VENV=.venv-verl-$VERL_VERSION
  CONSTRAINTS=constraints-verl-$VERL_VERSION.txt
  if [ ! -f "$CONSTRAINTS" ]; then
    echo "no pins for verl $VERL_VERSION ($CONSTRAINTS is missing); pinned versions:" \
      $(ls constraints-verl-*.txt 2>/dev/null | sed -e 's/constraints-verl-//' -e 's/\.txt$//') \
      "and the default (constraints.txt, no --verl)" >&2
    exit 2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip's own exit status survives the filter (pipefail); the filter only drops this
# machine's notes about absent local package mirrors.
pip_install() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
pip_install -c "$CONSTRAINTS" torch==2.13.0
pip_install -c "$CONSTRAINTS" -e ".[test]"

# Final check: the plugin registers its losses through the loading route this verl offers.
# verl 0.9.x loads the `verl.plugins` entry point on `import verl`; 0.8.x has no entry-point group,
# so there the check loads the plugin the way a 0.8 user does: VERL_USE_EXTERNAL_MODULES.
case "$VERL_VERSION" in
  0.8.*) ROUTE_ENV=(env VERL_USE_EXTERNAL_MODULES=verl_klcov_global); ROUTE="VERL_USE_EXTERNAL_MODULES" ;;
  *) ROUTE_ENV=(env); ROUTE="the verl.plugins entry point" ;;
esac
"${ROUTE_ENV[@]}" "$VENV/bin/python" -c "import torch, verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; assert 'kl_cov_global' in R, 'plugin not registered through $ROUTE'; print('setup ok ($VENV): torch', torch.__version__, 'verl', verl.__version__, '- plugin loaded through $ROUTE')" 2>&1 | tail -n 1
