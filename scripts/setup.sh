#!/usr/bin/env bash
# Creates .venv at the repository root (if missing) and installs the plugin with its test
# dependencies, pinned by constraints.txt (CPU torch 2.13.0). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# pip's own exit status survives the filter (pipefail); the filter only drops this
# machine's notes about absent local package mirrors.
pip_install() { .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
pip_install -c constraints.txt torch==2.13.0
pip_install -c constraints.txt -e ".[test]"
.venv/bin/python -c "import torch, verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; assert 'kl_cov_global' in R, 'plugin not registered through the entry point'; print('setup ok: torch', torch.__version__, 'verl', verl.__version__)" 2>&1 | tail -n 1
