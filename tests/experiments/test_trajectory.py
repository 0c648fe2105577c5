"""Whole training runs: the micro-batch size and the DP size do not change a ``*_global`` run.

The runs are verl 0.9.1's trainer loop (``RayPPOTrainer.fit``, legacy trainer) with verl's real
``ActorRolloutRefWorker`` and FSDP2 engine on CPU, Ray's process plumbing and the text generator
replaced in-process (``experiments.local_trainer``). GRPO, 3 steps of 4 prompts x 4
responses, 2 minibatches x 2 PPO epochs per step (12 optimizer steps), SGD (``RunConfig.optimizer``:
AdamW can turn float noise into a flipped selection near-tie; docs/EVIDENCE.md).

* Reproducible: the same configuration run twice gives identical rollouts, identical logged metrics
  (timings aside) and identical parameters, bit for bit.
* Micro-batch size 1 vs 4, per step: ``kl_cov_global`` and ``clip_cov_global`` differ from themselves
  by at most ``NOISE_FACTOR`` times what ``vanilla`` (no selection) differs for the same change --
  parameters, pg_loss, ppo_kl, grad_norm, entropy -- with identical selection counts; upstream
  ``kl_cov`` and ``clip_cov`` split by more than that (they do: by ~10^3 in parameters).
* DP 2 vs 1 (one minibatch per step, see ``experiments.trajectory``): the same verdicts.

Premise of kl_cov_global's micro-batch comparison, on every CPU: its runs have their log-prob pass (verl's
``log_prob_micro_batch_size_per_gpu``; the infer-layout prepass too) at their training micro-batch size
(``run_experiment(log_prob_follows_training=("kl_cov_global",))``; every other run, and the command, keep
4). At the first optimizer step of a trainer step pi = pi_old, and KL-Cov's penalty coef * |log pi - log
pi_old| has the gradient coef * sign(log pi - log pi_old) * grad log pi: with the pass in the training
micro-batch's company (verl's minibatches are contiguous, ``actor.shuffle`` False: the first minibatch's
micro-batches are the pass's) the difference is the same computation's, exactly 0; with the pass at 4 and
training at 1 it is float noise on CPUs whose rows' last bits follow their micro-batch company (AMD EPYC;
tests/support/company_noise.py), whose sign is a full-size gradient (kl_cov_global then parts by ~10^5x
vanilla, as upstream does). Later optimizer steps: the smallest |log pi - log pi_old| on a selected token
was 1.8e-4 (emulator on), ~370x that noise, so the sign is decided. Its two passes differ in the last bits,
which vanilla's floor (pass at 4 at both sizes) does not carry: the stricter comparison. The DP runs train at
micro-batch 4 with the pass at 4 on each rank's contiguous shard: again the pass's micro-batches.
The parameters' floor (``experiments.trajectory.verdict``): vanilla's largest difference, at least one
float32 spacing at each parameter's own magnitude (one rounding of a norm weight near 1 is 16x the whole
noise of the small weights, tests/support/noise_floor.py; the whole-model maximum made clip_cov_global's
verdict 8x here, on which parameter happened to round).

Also, fast: the random responses are a pure function of their key, and the ``cpu_random`` server of
the ``main_ppo`` tests serves them only for verl's stable request ids.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from experiments import random_responses
from experiments.local_trainer import RunConfig
from experiments.trajectory import NOISE_FACTOR, format_report, run_experiment

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

STEPS = 3


def _response(**overrides):
    kwargs = dict(seed=1, weight_version=0, request_key="det-3", prompt_ids=[1, 5, 9], max_tokens=24,
                  vocab_size=400, eos_token_id=2)
    kwargs.update(overrides)
    return random_responses.random_response(**kwargs)


def test_random_response_is_a_pure_function_of_its_key():
    first = _response()
    random.seed(12345)  # the process-wide generators play no part
    assert _response() == first
    assert 1 <= len(first) <= 24 and all(3 <= t < 400 for t in first[:-1])
    assert len({tuple(_response(request_key=f"det-{i}")) for i in range(8)}) == 8
    assert _response(weight_version=1) != first and _response(seed=2) != first
    assert _response(prompt_ids=[1, 5, 10]) != first


def test_cpu_random_server_answers_by_request_id_and_refuses_uuids():
    from ..trainer_support.rollout_server import RandomTokenServer

    async def generate(server, request_id):
        output = await server.generate(request_id, prompt_ids=[1, 5, 9], sampling_params={"max_tokens": 24})
        return output.token_ids

    a, b = RandomTokenServer(400, 2, 24, seed=1), RandomTokenServer(400, 2, 24, seed=1)
    first = [asyncio.run(generate(a, f"det-{i}")) for i in range(4)]
    second = [asyncio.run(generate(b, f"det-{i}")) for i in reversed(range(4))][::-1]  # another order
    assert first == second
    assert first[0] == _response(weight_version=None, request_key="det-0")
    # verl's v1 trainer sends the n requests of a prompt all as det-0: they still get n responses
    repeats = [asyncio.run(generate(a, "det-0")) for _ in range(3)]
    assert len({tuple(r) for r in repeats + [first[0]]}) == 4
    with pytest.raises(ValueError, match="full_determinism=True"):
        asyncio.run(generate(a, "3f2a9c0e1b7d4e6f8a0b1c2d3e4f5a6b"))


@pytest.fixture(scope="module")
def report(tiny_model_path, tmp_path_factory):
    result = run_experiment(RunConfig(steps=STEPS), model_path=tiny_model_path,
                            work_dir=str(tmp_path_factory.mktemp("trajectory")), dp=True,
                            log_prob_follows_training=("kl_cov_global",))
    print("\n" + format_report(result))
    return result


@pytest.mark.slow
@pytest.mark.distributed
def test_whole_runs_are_reproducible_and_global_modes_invariant(report):
    repeat = report["repeat"]
    assert repeat["same_rollouts"] and not repeat["metrics_differing"] and repeat["param_max_abs_diff"] == 0.0, repeat
    assert repeat["metrics_compared"] >= 10

    for part in ("mbs", "dp"):
        pairs, verdicts = report[part]["pairs"], report[part]["verdict"]
        assert all(pair["same_rollouts"] for pair in pairs.values()), part
        floor = max(pairs["vanilla"]["param_max_abs_diff"])
        assert floor > 0.0, f"{part}: vanilla shows no float noise at all; the comparison would be vacuous"
        for mode in ("kl_cov_global", "clip_cov_global"):
            v = verdicts[mode]
            assert v["selection_identical"], (part, mode, pairs[mode]["selection_metrics"])
            # premise (module docstring): kl_cov_global's pass at its training size; each parameter's own floor
            assert v["worst_ratio"] <= NOISE_FACTOR, (part, mode, v["ratios"])
        for mode in ("kl_cov", "clip_cov"):
            assert verdicts[mode]["ratios"]["params"] > NOISE_FACTOR, (part, mode, verdicts[mode]["ratios"])
    # micro-batch size: upstream's logged loss splits too, not only its parameters
    for mode in ("kl_cov", "clip_cov"):
        assert report["mbs"]["verdict"][mode]["ratios"]["actor/pg_loss"] > NOISE_FACTOR


@pytest.mark.slow
@pytest.mark.distributed
def test_selection_acts_in_every_step(report):
    """Not vacuous: in every trainer step every global run selected tokens and clip_cov_global clipped
    some (the tiny model's covariances need the low Clip-Cov window of RunConfig); so did upstream
    clip_cov at micro-batch 4. At micro-batch 1 upstream sees one sequence per loss call, whose GRPO
    advantage is constant: every covariance is 0 and it clips nothing (verl #7829 at its extreme).
    The logged figures are means over the step's optimizer steps."""
    curves = report["curves"]
    small, large = report["micro_batch_sizes"]
    for mbs in (small, large):
        assert min(curves[f"kl_cov_global/mbs{mbs}"]["actor/kl_cov/selected"]) >= 1
        assert min(curves[f"clip_cov_global/mbs{mbs}"]["actor/clip_cov/clipped"]) > 0
    assert min(curves[f"clip_cov/mbs{large}"]["actor/pg_clipfrac"]) > 0
    assert max(curves[f"clip_cov/mbs{small}"]["actor/pg_clipfrac"]) == 0
    assert len(curves["vanilla/mbs1"]["actor/pg_loss"]) == STEPS


@pytest.mark.slow
@pytest.mark.distributed
def test_picture_is_a_png_of_the_report_and_redraws_from_its_json(report, tmp_path, capsys):
    import argparse

    from experiments.study_cli import write_outputs
    from experiments.trajectory import main, plot

    path = tmp_path / "trajectory.png"
    plot(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    # --from-json: the report the command wrote prints the same text and draws the same picture
    saved = tmp_path / "out" / "trajectory.json"
    write_outputs(report, argparse.Namespace(json=str(saved), png=None), format_report, plot)
    capsys.readouterr()
    assert main(["--from-json", str(saved), "--png", str(tmp_path / "redrawn.png")]) == 0
    assert capsys.readouterr().out == format_report(report) + f"\npicture: {tmp_path / 'redrawn.png'}\n"
    assert (tmp_path / "redrawn.png").read_bytes() == path.read_bytes()
