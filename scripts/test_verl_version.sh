#!/usr/bin/env bash
# The verl-version jobs: set up the version's own venv (scripts/setup.sh --verl SOURCE), run the tests
# whose outcome depends on verl (seams, loading, configuration, losses, verl's real FSDP engine on
# CPU), then `verl-klcov-global diagnose --blocks 1` (exit 0 and a JSON saying "invariant"; the main job runs it
# with defaults).
#
#   bash scripts/test_verl_version.sh 0.8.0 [extra pytest args]   .venv-verl-0.8.0/, verl 0.8.0 from PyPI
#   bash scripts/test_verl_version.sh main  [extra pytest args]   .venv-verl-main/, verl main from the
#                                           source archive ../shared/verl-main/ (missing: the job fails)
#
# The main suite (.venv/, verl 0.9.1) runs every test. These jobs run what can break when only verl's version
# changes, each property once (CI time: before, they took 461 s and 416 s on a 2-core AMD runner); tests
# whose outcome cannot depend on verl are left to the main suite: tests/selection (the selection on torch alone,
# verl 0.9.1's own selection code copied into the test as the reference), tests/test_import_layers.py.
#
# 0.8.0: loading (VERL_USE_EXTERNAL_MODULES, the route 0.8 has), the seam check, configuration, driver, losses,
# the mode table and the controller's law (the fast files below, whole), the patch catalogue on 0.8's engine
# (tests/engine/test_patches.py), one engine-level invariance test (KL-Cov, static 64 vs 8 micro-batches,
# padded FSDP1), one reuse of verl's own log-prob pass (its worker code differs between versions), and
# `diagnose --blocks 1` (every mode of the table through 0.8's engine, 1 vs 8 micro-batches). Tests marked
# `needs_entry_point_group` (0.8 has no `verl.plugins` group) or `needs_driver_validate_config` (0.8's main_ppo
# validates in the TaskRunner, after ray.init) are deselected.
# main: the whole fast tier (`-m "not slow"`, less the version-independent files), then one engine-level
# invariance test per claim on verl's real FSDP engine (static micro-batches, DP 2 through a sampled Clip-Cov
# mask, the 80/20 prepass entropy = compute_log_prob's, the controller's first step), the reuse of verl's pass
# on an update's first step only, and `diagnose --blocks 1`.
#
# VERL_JOB_SETUP=0 skips the set-up (the venv exists already: .ci/run makes it in the background).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?"usage: bash scripts/test_verl_version.sh VERSION|main [pytest args], e.g. 0.8.0"}
shift
VENV=.venv-verl-$VERSION
export PYTHONUNBUFFERED=1
VERSION_INDEPENDENT=(--ignore=tests/selection --ignore=tests/test_import_layers.py)

# verl's log-prob pass in place of the prepass (engine/reuse.py), where it rests on verl's own worker code.
REUSE_ON_POLICY="tests/engine/test_reuse.py::test_an_on_policy_update_reuses_verls_pass_and_selects_what_the_prepass_selects[high_entropy_global-v1]"
REUSE_FIRST_STEP_ONLY="tests/engine/test_reuse.py::test_only_the_first_optimizer_step_of_an_update_reuses"
STATIC_INVARIANCE="tests/engine/test_engine_kl_cov.py::test_static_micro_batches_64_vs_8[padded-fsdp]"
# stare_global's gate reads verl's log-prob pass through TrainingWorker and is checked against verl's own agg_loss
STARE_GATE="tests/engine/test_engine_stare.py::test_the_gate_reads_the_drivers_actor_entropy_and_opens_where_the_forks_does[infer-token-mean]"
# lp_reg_global's proxy: PATCH proxy_log_prob_in_pass on verl's prepare_model_outputs (padded and packed forwards),
# checked against a plain Hugging Face forward, and the TrainingWorker route that keeps it
LP_REG_PROXY="tests/engine/test_engine_lp_reg.py::test_the_held_proxy_is_an_independent_full_vocabulary_computation"
LP_REG_WORKER="tests/engine/test_engine_lp_reg.py::test_the_worker_holds_the_proxy_for_every_optimizer_step_of_the_update[infer]"

SECONDS=0
if [ "${VERL_JOB_SETUP:-1}" != 0 ]; then
  bash scripts/setup.sh --verl "$VERSION"
  echo "verl $VERSION job: setup ${SECONDS} s"; SECONDS=0
fi

# pytest exits 5 when it selected no test: under `set -e` that fails the job, as it must.
if [ "$VERSION" = main ]; then
  "$VENV/bin/python" -m pytest -q -m "not slow" "${VERSION_INDEPENDENT[@]}" tests "$@"
  echo "verl $VERSION job: fast tier ${SECONDS} s"; SECONDS=0
  "$VENV/bin/python" -m pytest -q \
    "$STATIC_INVARIANCE" \
    "tests/engine/test_engine_clip_cov.py::test_sampled_mask_on_two_dp_ranks_is_the_single_rank_mask" \
    "tests/engine/test_engine_high_entropy.py::test_prepass_entropy_is_verls_compute_log_prob_entropy_bit_for_bit" \
    "tests/engine/test_entropy_control.py::test_the_first_step_is_bit_identical_for_3_vs_5_micro_batches_and_dp_1_vs_2" \
    "$REUSE_ON_POLICY" "$REUSE_FIRST_STEP_ONLY" "$STARE_GATE" "$LP_REG_PROXY" "$LP_REG_WORKER" "$@"
  echo "verl $VERSION job: engine invariance ${SECONDS} s"; SECONDS=0
else
  SUBSET=(
    tests/test_seams.py
    tests/test_loading_routes.py
    tests/test_config.py
    tests/test_driver.py
    tests/test_loss.py
    tests/test_modes.py
    tests/test_layout.py
    tests/test_adding_a_mode.py
    tests/test_entropy_control.py
    tests/test_reuse_rows.py
    tests/engine/test_patches.py
    "$STATIC_INVARIANCE"
    "$REUSE_ON_POLICY"
    "$STARE_GATE"
    "$LP_REG_PROXY"
    "$LP_REG_WORKER"
  )
  "$VENV/bin/python" -m pytest -q -m "not needs_entry_point_group and not needs_driver_validate_config" \
    "${SUBSET[@]}" "$@"
  echo "verl $VERSION job: tests ${SECONDS} s"; SECONDS=0
fi

mkdir -p out
"$VENV/bin/verl-klcov-global" diagnose --blocks 1 --json "out/diagnose-verl-$VERSION.json"
"$VENV/bin/python" - "out/diagnose-verl-$VERSION.json" <<'PY'
import json, sys
import verl
report = json.load(open(sys.argv[1]))
assert report["invariant"] is True, report["verdict"]
for mode in ("kl_cov_global", "clip_cov_global", "high_entropy_global"):
    assert report["modes"][mode]["masks_identical"] is True, mode
print(f"diagnose on verl {verl.__version__} ok:", report["verdict"])
PY
echo "verl $VERSION job: diagnose ${SECONDS} s"
