"""stare_global on verl 0.9.1's real trainer loop: the gate reads what the driver logs as ``actor/entropy``.

Runs ``RayPPOTrainer.fit`` (legacy trainer) in-process with verl's real ``ActorRolloutRefWorker`` and FSDP2 engine on
CPU, fp32 (:mod:`experiments.local_trainer`), GRPO, 3 steps of 4 prompts x 4 responses, 2 minibatches x 2 PPO epochs
(4 optimizer steps a trainer step), the adaptive schedule on, the target above any entropy of the tiny model (the
gate open) and the variant C2. Required, at every trainer step:

* the worker's ``actor/stare/batch_entropy`` equals the driver's ``actor/entropy`` (verl's ``agg_loss`` over the
  step's whole batch, float32 on the driver) within 1e-6 relative: the same statistic, reduced exactly in the
  workers;
* the gate is open and W, M move once per trainer step (not per minibatch or epoch): W = 1.1 + 0.01 s and
  M = 0.9 - 0.01 s at step s, the mean over the step's optimizer steps being exactly that value;
* the selection acted on both signs.
"""

from __future__ import annotations

import pytest
import torch

from verl_klcov_global.lab import cpu as _cpu
from experiments import local_trainer

pytestmark = pytest.mark.slow  # verl's real trainer loop on CPU

STEPS = 3
KNOBS = (("stare_target_entropy", 100.0), ("stare_adaptive", True), ("stare_variant", "C2"),
         ("stare_top_ratio", 0.2))


@pytest.fixture(scope="module")
def metrics(tiny_model_path, tmp_path_factory):
    _cpu.install_cpu_platform()
    _cpu.init_process_group_cpu(0, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = local_trainer.RunConfig(loss_mode="stare_global", steps=STEPS, stare_knobs=KNOBS)
        return local_trainer.run_trainer(config, model_path=tiny_model_path,
                                         work_dir=str(tmp_path_factory.mktemp("stare"))).metrics
    finally:
        torch.set_num_threads(threads)


def test_the_gate_reads_the_drivers_actor_entropy_once_per_trainer_step(metrics):
    assert len(metrics) == STEPS
    for step, figures in enumerate(metrics, 1):
        driver, worker = figures["actor/entropy"], figures["actor/stare/batch_entropy"]
        assert abs(worker - driver) <= 1e-6 * driver, (step, worker, driver)
        assert figures["actor/stare/gate_on"] == 1.0
        assert figures["actor/stare/reweight_w_in_use"] == pytest.approx(1.1 + 0.01 * step, abs=1e-12)
        assert figures["actor/stare/reweight_m_in_use"] == pytest.approx(0.9 - 0.01 * step, abs=1e-12)
        assert figures["actor/stare/selected_positive"] >= 1 and figures["actor/stare/selected_negative"] >= 1
    print(f"\nstare_global, {STEPS} trainer steps: |batch_entropy - actor/entropy| / actor/entropy at most "
          f"{max(abs(m['actor/stare/batch_entropy'] - m['actor/entropy']) / m['actor/entropy'] for m in metrics):.2e}")
