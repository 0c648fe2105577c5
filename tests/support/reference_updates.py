"""Updates of a frozen minibatch, made by whichever plugin source is imported, to show that a later version with its
new features off changes nothing against 0.4.1 (``tests/engine/test_controller_off.py``).

:func:`record` runs, on verl's real FSDP engine (CPU, fp32, the lab's SGD engine), one optimizer update of a frozen
minibatch per (loss mode, micro-batch layout): ``vanilla`` (the canary: it goes through no plugin code) and the three
global modes, each in 1 and in 4 static micro-batches. It returns, per update, what must stay bit-identical:

* ``masks``: each optimizer step's selection mask, as the hex of its bits (row-major) and its shape;
* ``pg_loss``: ``actor/pg_loss`` of every micro-batch, ``grad_norm``, as ``float.hex`` (exact);
* ``params``: the sha256 of the updated parameters (float64, sorted-key order, ``lab.cpu.engine_params_flat``)
  and, to read a mismatch, their sum and largest change from the initial weights as ``float.hex``.

It uses only the lab API that 0.4.1 already had, so the same file runs against both sources.

**Both sides are made on the machine that compares them** (:func:`record_in_subprocess`): 0.4.1's source is taken
from this repository's own history (commit :data:`SOURCE_0_4_1`, extracted with ``git archive``, never checked out
over the working tree) and put first on ``PYTHONPATH`` of a fresh interpreter; the source under test runs the same
command with its own ``src/``. Same machine, same torch, one thread each, same inputs: the premise of bit for bit is
"the same computation on the same inputs", true on any CPU. (0.7.0 compared with JSON files recorded on an Intel
AVX512 and an AMD AVX2 machine; an AMD AVX512 runner matched neither, and a recording per kind of CPU fails on the
next kind.) By hand::

    git archive 5810af9 src pyproject.toml | tar -x -C /tmp/src-0.4.1
    PYTHONPATH=/tmp/src-0.4.1/src .venv/bin/python -m tests.support.reference_updates /tmp/updates-0.4.1.json
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[2]
#: 0.4.1's source: the last commit before any entropy-controller code (its version string reads 0.4.1).
SOURCE_0_4_1 = "5810af934529bb1dca676668fc8bd3bac0197b15"
MODEL_SEED = 0
BATCH, PROMPT, RESPONSE = 16, 8, 32
LAYOUTS = (1, 4)  # static micro-batches of 16 and of 4 rows
#: The knobs of each recorded mode (a clip_cov window with candidates on the tiny model; diagnose's).
KNOBS = {
    "vanilla": {},
    "kl_cov_global": dict(kl_cov_ratio=0.02, ppo_kl_coef=1.0),
    "clip_cov_global": dict(clip_cov_ratio=0.02, clip_cov_lb=0.3, clip_cov_ub=5.0, clip_cov_seed=7),
    "high_entropy_global": dict(entropy_top_ratio=0.2),
}


def actor_config(mode: str):
    """The recorded actor config of ``mode`` (the plugin's config class for a global mode)."""
    from verl_klcov_global.config import (
        ClipCovGlobalPolicyLossConfig, HighEntropyGlobalPolicyLossConfig, KLCovGlobalPolicyLossConfig,
    )
    from verl_klcov_global.lab import tiny

    classes = {"kl_cov_global": KLCovGlobalPolicyLossConfig, "clip_cov_global": ClipCovGlobalPolicyLossConfig,
               "high_entropy_global": HighEntropyGlobalPolicyLossConfig}
    if mode == "vanilla":
        return tiny.make_actor_config(loss_mode="vanilla")
    return tiny.make_actor_config(policy_loss=classes[mode](**KNOBS[mode]))


def _model_digest(path: str) -> str:
    """sha256 over the tiny model's weight file (both sources must build the same model)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _bits(mask: torch.Tensor) -> str:
    """A bool mask as the hex of its bits, row-major (``numpy.packbits``)."""
    import numpy as np

    return np.packbits(mask.to(torch.bool).reshape(-1).numpy()).tobytes().hex()


def _hex_list(metric) -> list[str]:
    values = metric.values if hasattr(metric, "values") else [metric]
    return [float(torch.as_tensor(v).item()).hex() for v in values]


def record(model_path: str) -> dict:
    """The figures of every (mode, layout) update (see the module docstring)."""
    from verl_klcov_global.lab import cpu
    from verl_klcov_global.lab.experiment import EngineSpec, frozen_minibatch, one_update, static_layouts

    cpu.install_cpu_platform()
    cpu.init_process_group_cpu()
    torch.manual_seed(0)
    spec = EngineSpec(model_path=model_path, infer_micro_batch_size_per_gpu=8)
    batch = frozen_minibatch(spec, seed=11, batch_size=BATCH, prompt_len=PROMPT, response_len=RESPONSE,
                             vary_lengths=True)
    initial = cpu.engine_params_flat(spec.build())
    updates = {}
    for mode in KNOBS:
        for layout in static_layouts(BATCH, LAYOUTS[1]):
            outcome = one_update(spec, batch, actor_config(mode), layout)
            params = outcome.params
            updates[f"{mode} / {layout.name}"] = {
                "masks": [{"shape": list(mask.shape), "bits": _bits(mask)}
                          for mask in outcome.masks],
                "pg_loss": _hex_list(outcome.metrics["actor/pg_loss"]),
                "grad_norm": _hex_list(outcome.metrics["grad_norm"]),
                "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
                "params_sum": float(params.sum()).hex(),
                "params_max_change": float((params - initial).abs().max()).hex(),
            }
    return {"model_sha256": _model_digest(model_path), "updates": updates}


def machine() -> dict:
    """What decides this machine's float arithmetic, as far as torch tells (and the CPU's name, to read it)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "cpu": _cpu_name()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def source_version() -> str:
    """The version of the plugin source that runs: the ``pyproject.toml`` beside an imported checkout's ``src/``
    (an extracted 0.4.1 source on ``PYTHONPATH``), else the installed metadata's."""
    import verl_klcov_global

    pyproject = Path(verl_klcov_global.__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        for line in pyproject.read_text().splitlines():
            if line.startswith("version = "):
                return line.split('"')[1]
    return verl_klcov_global.__version__


class HistoryMissing(RuntimeError):
    """The repository's history does not hold the 0.4.1 source (a shallow clone, an export without ``.git``)."""


def extract_source(commit: str, into: str) -> str:
    """``src/`` and ``pyproject.toml`` of ``commit`` from this repository's history, extracted under ``into``;
    returns the ``src`` folder. Raises :class:`HistoryMissing` with the fix when git or the commit is absent."""
    probe = subprocess.run(["git", "-C", str(REPOSITORY), "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise HistoryMissing(
            f"the 0.4.1 source (commit {commit[:7]}) is not in this checkout's git history ({REPOSITORY}): "
            f"{probe.stderr.strip() or 'git failed'}. The comparison with 0.4.1 builds its reference from the "
            "history on this machine; clone the repository with its history (not --depth), or run "
            "`git fetch --unshallow` in a shallow clone.")
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", commit, "src", "pyproject.toml"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return os.path.join(into, "src")


def record_in_subprocess(source: str, out_json: str) -> subprocess.Popen:
    """Starts ``python -m tests.support.reference_updates out_json`` in a fresh interpreter with ``source`` (a
    ``src/`` folder) first on its path, one torch thread; returns the process (its output piped)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([source, str(REPOSITORY)]), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "tests.support.reference_updates", out_json], cwd=REPOSITORY,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main(argv: list[str]) -> None:
    from verl_klcov_global.lab.tiny import build_tiny_model

    torch.set_num_threads(1)  # both sides with one thread: a reduction's split depends on the count
    with tempfile.TemporaryDirectory() as work:
        figures = record(build_tiny_model(f"{work}/model", seed=MODEL_SEED))
    figures.update(version=source_version(), machine=machine())
    with open(argv[0], "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
