#!/usr/bin/env bash
# The user's route (README, "Install"), as a new user takes it, proven from the built wheel:
#
#   1. build the wheel from this checkout (pip wheel, as README says);
#   2. install it into a fresh venv OUTSIDE the checkout, with the test pins as constraints
#      (constraints.txt: CPU torch 2.13.0, verl 0.9.1) and the test extra (the CPU e2e run needs it);
#   3. from an empty directory (no configs anywhere near it):
#      `verl-klcov-global diagnose --config-name kl_cov_global --blocks 1` must exit 0, and
#      `python -m verl.trainer.main_ppo --config-name=clip_cov_global --cfg job` must resolve
#      `loss_mode: clip_cov_global` -- both found only through the wheel's configs and its Hydra
#      search-path plugin;
#   4. one real 2-step CPU GRPO `main_ppo` run with the installed wheel: tests/test_trainer_e2e.py's
#      legacy run (`--config-name=kl_cov_global`, Ray, 2 FSDP2 ranks), its CPU support taken from this
#      checkout's tests/ (never src/: the layout keeps the package out of the checkout's root), and
#      then the check that the driver and every worker imported verl_klcov_global from the venv's
#      site-packages.
#
#   bash scripts/test_wheel.sh                 all four steps (KEEP=1 keeps the temporary folder)
#   bash scripts/test_wheel.sh --prepare DIR   steps 1-2 only, into DIR (a new folder outside the checkout)
#   bash scripts/test_wheel.sh --from DIR      steps 3-4 with the wheel and venv that --prepare left in DIR
#
# .ci/run prepares in the background while the main suite runs (pip's work is mostly I/O), then
# runs --from DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
STEPS=all
case "${1:-}" in
  "") WORK=$(mktemp -d "${TMPDIR:-/tmp}/verl-klcov-global-wheel.XXXXXX") ;;
  --prepare|--from) STEPS=${1#--}; WORK=${2:?"$1 needs a folder"}; WORK=$(mkdir -p "$WORK" && cd "$WORK" && pwd) ;;
  *) echo "usage: bash scripts/test_wheel.sh [--prepare DIR | --from DIR]" >&2; exit 2 ;;
esac
case "$WORK" in "$REPO"/*) echo "test_wheel: $WORK is inside the checkout" >&2; exit 2 ;; esac
cleanup() {
  if [ "$STEPS" = prepare ] || [ "${KEEP:-0}" = 1 ] || [ "${ok:-0}" != 1 ]; then echo "test_wheel: kept $WORK"
  else rm -rf "$WORK"; fi
}
trap cleanup EXIT
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
TOTAL=0
VENV=$WORK/venv

if [ "$STEPS" = from ]; then
  [ -f "$WORK/prepared" ] || { echo "test_wheel: $WORK holds no prepared wheel and venv (run --prepare first)" >&2; exit 2; }
  WHEEL=$(ls "$WORK"/dist/verl_klcov_global-*.whl)
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
else
# -- 1. the wheel ---------------------------------------------------------------------------------
SECONDS=0
rm -rf "$WORK/dist" "$WORK/prepared"
# The build writes src/*.egg-info in the checkout: one build at a time (scripts/setup.sh takes the same lock).
mkdir -p "$REPO/out"
flock "$REPO/out/.build.lock" "$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$REPO" 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
WHEEL=$(ls "$WORK"/dist/verl_klcov_global-*.whl)
"$PYTHON" - "$WHEEL" <<'PY'
import os, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = {"verl_klcov_global/configs/kl_cov_global.yaml", "verl_klcov_global/configs/clip_cov_global.yaml",
        "verl_klcov_global/configs/high_entropy_global.yaml",
        "hydra_plugins/verl_klcov_global_searchpath/verl_klcov_global_searchpath.py"}
assert need <= names, sorted(need - names)
assert not any(n.startswith("hydra_plugins/__init__") for n in names), "hydra_plugins must stay a namespace package"
# exactly the package's files under src/ (a stale build/ folder can add removed modules to a wheel)
src = os.path.join(os.getcwd(), "src")
tree = {os.path.relpath(os.path.join(d, f), src) for d, _, files in os.walk(src) if ".egg-info" not in d
        and "__pycache__" not in d for f in files if f.endswith((".py", ".yaml"))}
packaged = {n for n in names if ".dist-info/" not in n}
assert packaged == tree, {"only in the wheel": sorted(packaged - tree), "only in src/": sorted(tree - packaged)}
print(f"wheel ok: {sys.argv[1].rsplit('/', 1)[-1]}, {len(names)} files, configs and search-path plugin included")
PY
echo "wheel job: build ${SECONDS} s"; TOTAL=$((TOTAL + SECONDS)); SECONDS=0

# -- 2. a fresh venv outside the checkout ----------------------------------------------------------
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q -c "$REPO/constraints.txt" torch==2.13.0
quiet "$VENV/bin/python" -m pip install -q -c "$REPO/constraints.txt" "$WHEEL[test]"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "wheel job: venv ${SECONDS} s"; TOTAL=$((TOTAL + SECONDS)); SECONDS=0
touch "$WORK/prepared"
if [ "$STEPS" = prepare ]; then echo "wheel job: prepared in $WORK: total ${TOTAL} s"; exit 0; fi
fi

# -- 3. from a directory with no configs ----------------------------------------------------------
USER_DIR=$WORK/user
mkdir -p "$USER_DIR"
cd "$USER_DIR"
"$VENV/bin/python" - "$SITE" <<'PY'
import json, os, sys
from importlib import metadata
import verl_klcov_global
site = sys.argv[1]
assert verl_klcov_global.__file__.startswith(os.path.join(site, "verl_klcov_global") + os.sep), verl_klcov_global.__file__
direct_url = json.loads(metadata.distribution("verl-klcov-global").read_text("direct_url.json") or "{}")
assert not direct_url.get("dir_info", {}).get("editable", False), direct_url
assert verl_klcov_global.__version__ == metadata.version("verl-klcov-global"), verl_klcov_global.__version__
print(f"installed: verl-klcov-global {verl_klcov_global.__version__} from {os.path.dirname(verl_klcov_global.__file__)}")
PY
"$VENV/bin/verl-klcov-global" diagnose --config-name kl_cov_global --blocks 1 > diagnose.out
grep -F "config: kl_cov_global from $SITE/verl_klcov_global/configs" diagnose.out
grep "^verdict:" diagnose.out
echo "wheel job: diagnose --config-name kl_cov_global ${SECONDS} s"; TOTAL=$((TOTAL + SECONDS)); SECONDS=0
"$VENV/bin/python" -m verl.trainer.main_ppo --config-name=clip_cov_global --cfg job > cfg_job.out 2> cfg_job.err \
  || { tail -n 30 cfg_job.err; exit 1; }
grep -A3 "^    policy_loss:" cfg_job.out
grep -q "^      loss_mode: clip_cov_global$" cfg_job.out
grep -q "^      _target_: verl_klcov_global.config.ClipCovGlobalPolicyLossConfig$" cfg_job.out
echo "main_ppo --config-name=clip_cov_global --cfg job: loss_mode clip_cov_global"
[ -z "$(ls -A "$USER_DIR" | grep -v -e '^diagnose.out$' -e '^cfg_job' -e '^outputs$')" ]  # still no configs here
echo "wheel job: main_ppo --cfg job ${SECONDS} s"; TOTAL=$((TOTAL + SECONDS)); SECONDS=0

# -- 4. a real 2-step CPU GRPO main_ppo with the installed wheel -----------------------------------
cd "$REPO"
[ ! -e "$REPO/verl_klcov_global" ]  # the checkout's root holds no copy of the package (src layout)
PYTHONPATH=$REPO "$VENV/bin/python" -c "import verl_klcov_global as p, sys; assert p.__file__.startswith(sys.argv[1]), p.__file__" "$SITE/"
E2E_TEST=test_main_ppo_grpo_on_cpu_runs_kl_cov_global_prepass_per_minibatch
E2E_FILE=$(grep -rl --include='test_*.py' "def $E2E_TEST" tests)  # wherever the tests tree keeps it
"$VENV/bin/python" -m pytest -q -n 0 -p no:cacheprovider --basetemp="$WORK/pytest" "$E2E_FILE::$E2E_TEST[legacy]"
"$VENV/bin/python" - "$WORK/pytest" "$SITE" <<'PY'
import glob, json, os, sys
root, site = sys.argv[1:]
paths = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(root, "**", "steps-*.jsonl"), recursive=True)})
records = [json.loads(line) for path in paths for line in open(path)]
files = {r["plugin_file"] for r in records}
ranks = {r["rank"] for r in records}
assert records and ranks == {0, 1}, (len(records), ranks)
assert all(f and f.startswith(os.path.join(site, "verl_klcov_global") + os.sep) for f in files), files
print(f"main_ppo workers: {len(records)} optimizer steps recorded in {len(paths)} files, ranks {sorted(ranks)}, "
      f"plugin imported from {files.pop()}")
PY
echo "wheel job: main_ppo 2-step GRPO ${SECONDS} s"; TOTAL=$((TOTAL + SECONDS))
echo "wheel job: total ${TOTAL} s"
ok=1
