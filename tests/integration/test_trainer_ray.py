"""``kl_cov_global`` in verl's trainer config and inside verl's Ray workers (CPU).

Hydra (fast): ``loss_mode=kl_cov_global`` on verl's own ``ppo_trainer`` config and
``configs/kl_cov_global.yaml`` pass verl's ``validate_config`` and conversion to ``ActorConfig``;
bad knob values fail there, naming the key; the plugin's config class loads the plugin where entry
points are off and does not swallow a broken one.

Ray (slow): a local Ray cluster (2 CPUs, no GPU) runs a 2-rank data-parallel worker group of verl
0.9.1's real ``ActorRolloutRefWorker(role="actor")`` (test-only subclass
:class:`ObservedActorRolloutRefWorker`, which only adds read-outs of the prepasses its own process
ran), configured by ``configs/kl_cov_global.yaml``; the CPU platform reaches the workers through
``VERL_USE_EXTERNAL_MODULES`` (``tests/trainer_support``). Each update goes through the trainer's
own ``_update_actor`` -- the legacy ``RayPPOTrainer``'s (padded ``DataProto``) and the v1
``PPOTrainer``'s (nested per-sample rows, TransferQueue replaced by an in-memory bridge) -- then
``update_actor`` -> ``train_mini_batch`` in the workers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..trainer_support import batches, trainer
from ..trainer_support.env import INHERITED_ENV_TO_DROP, REPO_ROOT, ray_process_env, subprocess_env

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

WORLD_SIZE = 2                      # data-parallel ranks (Ray workers)
PROMPTS, N = 4, 4                   # data.train_batch_size prompts x rollout.n responses = 16 sequences
MINI_BATCH_PROMPTS, EPOCHS = 2, 2   # 8 sequences per optimizer step (4 per rank), 2 PPO epochs
STEPS = EPOCHS * PROMPTS // MINI_BATCH_PROMPTS  # 4 optimizer steps per update
ROWS_PER_RANK = MINI_BATCH_PROMPTS * N // WORLD_SIZE
PROMPT_LEN, RESPONSE_LEN = 8, 24
RATIO = 0.05                        # 8 x <=24 response tokens per step: a quota of several tokens


def _overrides(model_path: str) -> list[str]:
    return trainer.cpu_overrides(model_path, n_gpus=WORLD_SIZE) + [
        "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.name=cpu_random",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.strategy=fsdp",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.ppo_epochs={EPOCHS}",
        "actor_rollout_ref.actor.shuffle=True",
        "actor_rollout_ref.actor.optim.lr=0.01",
        f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio={RATIO}",
    ]


# -- Hydra: the config verl validates and converts (driver) and every worker converts again -----------


def _actor_config(config):
    from verl.utils.config import omega_conf_to_dataclass

    trainer.validate_trainer_config(config)
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def test_plain_loss_mode_override_passes_verls_validation_and_conversion(tiny_model_path):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    from verl_klcov_global.config import read_kl_cov_settings
    from verl_klcov_global.modes import global_mode_of
    from verl_klcov_global.methods.kl_cov.row import KL_COV

    config = trainer.compose_trainer_config(
        _overrides(tiny_model_path) + ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov_global"],
        plugin_config=False)
    actor = _actor_config(config)
    assert type(actor) is FSDPActorConfig and type(actor.policy_loss) is PolicyLossConfig
    assert global_mode_of(actor) is KL_COV
    assert read_kl_cov_settings(actor).kl_cov_ratio == RATIO


def test_configs_yaml_selects_the_plugin_config_and_takes_overrides_without_plus(tiny_model_path):
    from verl_klcov_global.config import KLCovGlobalPolicyLossConfig, read_kl_cov_settings

    config = trainer.compose_trainer_config(
        _overrides(tiny_model_path) + ["actor_rollout_ref.actor.policy_loss.prepass_layout=train"])
    actor = _actor_config(config)
    assert type(actor.policy_loss) is KLCovGlobalPolicyLossConfig
    settings = read_kl_cov_settings(actor)
    assert (settings.kl_cov_ratio, settings.ppo_kl_coef, settings.prepass_layout) == (RATIO, 1.0, "train")


@pytest.mark.parametrize("override, message", [
    ("prepass_layout=batch", r"prepass_layout must be one of \('infer', 'train', 'old'\), got 'batch'.*policy_loss"),
    ("kl_cov_ratio=0", r"kl_cov_ratio must be finite and in \(0, 1\].*policy_loss.kl_cov_ratio"),
    ("kl_cov_ratio=1.5", r"kl_cov_ratio must be finite and in \(0, 1\].*policy_loss.kl_cov_ratio"),
    ("ppo_kl_coef=-1", r"ppo_kl_coef must be finite and >= 0.*policy_loss.ppo_kl_coef"),
    ("loss_mode=vanilla", r"loss_mode is 'vanilla'.*policy_loss.loss_mode=kl_cov_global.*policy_loss._target_"),
])
def test_configs_yaml_bad_values_fail_verls_validation_with_the_key_to_change(tiny_model_path, override,
                                                                              message):
    config = trainer.compose_trainer_config(
        _overrides(tiny_model_path) + [f"actor_rollout_ref.actor.policy_loss.{override}"])
    with pytest.raises(Exception, match=f"(?s){message}"):
        trainer.validate_trainer_config(config)


def test_plugin_config_class_loads_the_plugin_without_entry_points_and_surfaces_a_broken_one():
    """``policy_loss._target_`` imports the plugin wherever the actor config is built (driver, each worker):
    it works with entry points off (e.g. an existing Ray cluster started before the install), and a
    plugin that fails to import fails the conversion instead of being logged at DEBUG."""
    code = f"""
import sys
sys.path.insert(0, {REPO_ROOT!r})
from tests.trainer_support import trainer
from verl.utils.config import omega_conf_to_dataclass
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.engine.base import BaseEngine
actor = trainer.compose_trainer_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]).actor_rollout_ref.actor
assert "kl_cov_global" not in POLICY_LOSS_REGISTRY
sys.modules["verl_klcov_global.engine.patches"] = None  # a broken install: the hook module cannot be imported
try:
    omega_conf_to_dataclass(actor)
except Exception as error:  # hydra names the target; the import error is its cause
    assert "verl_klcov_global.config.KLCovGlobalPolicyLossConfig" in str(error), error
    causes = []
    while error is not None:
        causes.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(c, ImportError) and "verl_klcov_global.engine.patches" in str(c) for c in causes), causes
else:
    raise AssertionError("a broken plugin was swallowed")
del sys.modules["verl_klcov_global.engine.patches"]
omega_conf_to_dataclass(actor)
assert "kl_cov_global" in POLICY_LOSS_REGISTRY
assert getattr(BaseEngine.train_batch, "__verl_klcov_global_original__", None) is not None
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=subprocess_env(VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES=""))
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stdout[-3000:]


# -- Ray workers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_actor_group(tiny_model_path):
    """(config, worker group): 2 Ray workers with an initialised FSDP actor each; Ray shut down after."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from ..trainer_support.workers import ObservedActorRolloutRefWorker

    config = trainer.compose_trainer_config(_overrides(tiny_model_path))
    trainer.validate_trainer_config(config)

    with pytest.MonkeyPatch.context() as env:
        for name in INHERITED_ENV_TO_DROP:  # the workers inherit the environment of ray.init's caller
            env.delenv(name, raising=False)
        ray.init(num_cpus=WORLD_SIZE, num_gpus=0, include_dashboard=False, object_store_memory=200 * 1024**2,
                 runtime_env={"env_vars": ray_process_env(threads_per_process=1)})
    try:
        pool = RayResourcePool(process_on_nodes=[WORLD_SIZE], use_gpu=False, max_colocate_count=1)
        worker_cls = RayClassWithInitArgs(cls=ray.remote(ObservedActorRolloutRefWorker),
                                          config=config.actor_rollout_ref, role="actor")
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_cls, device_name="cpu")
        group.init_model()
        yield config, group
    finally:
        ray.shutdown()


def _check_update(records, step_metrics):
    """Evidence from the workers: one prepass per optimizer step, its figures in the returned metrics."""
    assert len(records) == WORLD_SIZE
    for rank, worker_records in enumerate(records):
        assert len(worker_records) == STEPS, (rank, worker_records)  # one prepass per optimizer step
        assert {r["pid"] for r in worker_records} != {os.getpid()}
        assert len({r["pid"] for r in worker_records}) == 1
        assert all(r["rank"] == rank and r["rows"] == ROWS_PER_RANK for r in worker_records)
    pids = {records[rank][0]["pid"] for rank in range(WORLD_SIZE)}
    assert os.getpid() not in pids and len(pids) == WORLD_SIZE

    # One global selection per step: every rank got the same quota and selection size.
    quotas = [[r["quota"] for r in worker_records] for worker_records in records]
    selected = [[r["selected"] for r in worker_records] for worker_records in records]
    assert all(q == quotas[0] for q in quotas) and all(q > 1 for q in quotas[0])
    per_step_selected = [sum(s[step] for s in selected) for step in range(STEPS)]
    assert per_step_selected == quotas[0]

    # train_mini_batch appends one value per optimizer step for every metric the hook/loss add.
    assert [float(v) for v in step_metrics["actor/kl_cov/quota"]] == [float(q) for q in quotas[0]]
    assert [float(v) for v in step_metrics["actor/kl_cov/selected"]] == [float(q) for q in quotas[0]]
    assert len(step_metrics["actor/kl_cov/prepass_seconds"]) == STEPS
    assert step_metrics["actor/kl_cov/prepass_seconds"] == pytest.approx(
        [sum(rec[step]["prepass_seconds"] for rec in records) / WORLD_SIZE for step in range(STEPS)])
    for name in ("valid_tokens", "nonfinite_tokens", "cov_threshold", "selected_in_micro_batch",
                 "selection_seconds"):
        assert f"actor/kl_cov/{name}" in step_metrics, name


@pytest.mark.slow
def test_legacy_trainer_update_runs_one_prepass_per_optimizer_step_in_each_worker(ray_actor_group):
    config, group = ray_actor_group
    assert group.hook_installed() == [True] * WORLD_SIZE
    group.reset_prepass_records()

    batch = batches.legacy_batch(batch_size=PROMPTS * N, prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN,
                                 group_size=N, seed=1)
    metrics = trainer.legacy_update_actor(config, group, batch)

    _check_update(group.prepass_records(), metrics)
    print(f"\n[legacy] quotas per step {metrics['actor/kl_cov/quota']}")


@pytest.mark.slow
def test_v1_trainer_update_runs_one_prepass_per_optimizer_step_in_each_worker(ray_actor_group):
    config, group = ray_actor_group
    group.reset_prepass_records()

    rows = batches.v1_batch(batch_size=PROMPTS * N, prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN,
                            group_size=N, seed=2)
    reduced, raw = trainer.v1_update_actor(config, group, rows)

    _check_update(group.prepass_records(), raw)
    # the v1 trainer reduces each metric to its mean over steps before logging it
    assert reduced["actor/kl_cov/quota"] == pytest.approx(sum(raw["actor/kl_cov/quota"]) / STEPS)
    assert "actor/kl_cov/prepass_seconds" in reduced
    print(f"\n[v1] quotas per step {raw['actor/kl_cov/quota']}")


@pytest.mark.slow
def test_missing_hook_in_a_worker_fails_the_update_with_the_fix(ray_actor_group):
    """A worker where the plugin's hook is not active must not train silently."""
    config, group = ray_actor_group
    group.uninstall_hook()
    try:
        assert group.hook_installed() == [False] * WORLD_SIZE
        batch = batches.legacy_batch(batch_size=PROMPTS * N, prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN,
                                     group_size=N, seed=3)
        with pytest.raises(Exception, match=r"(?s)KLCovMaskUnavailableError.*VERL_USE_EXTERNAL_MODULES"):
            trainer.legacy_update_actor(config, group, batch)
    finally:
        group.install_hook()
