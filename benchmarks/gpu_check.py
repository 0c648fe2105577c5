"""The GPU validation kit: proves the plugin on a real accelerator in one prepared command.

Run through ``bash scripts/gpu_check.sh`` (it installs the carried wheels and sets the path);
``--smoke`` runs the same code on CPU with tiny sizes (CI). Four phases, each with a time budget;
after each one a table is printed and the whole JSON report is rewritten, so a run cut short keeps
what it finished:

``env``       versions, accelerator, how the plugin was loaded, Ray real or stub, the loss modes the
              plugin registered and their verl counterparts, the log-prob kernel verl will pick;
``branches``  the hook's accelerator-only branches on verl's FSDP1 engine (:mod:`.gpu_branches`):
              device RNG restored, accelerator logits path, NCCL single-rank group, prepass
              log-probs bit-identical to verl's compute_log_prob;
``diagnose``  ``verl-klcov-global diagnose`` (the #7829 experiment, FSDP2) in fp32 and bf16 for every
              global loss mode the plugin registered: invariance verdict and ratios to the control;
``step``      a Qwen2.5-0.5B-shaped random model in bf16, remove-padding and dynamic batching,
              2k-4k-token responses (:mod:`.gpu_step`): step time global / verl mode, prepass vs
              verl's compute_log_prob time, peak memory of each, attention and log-prob kernels
              that ran.

Exit status: 0 all checks passed; 1 a check failed; 2 bad usage or no accelerator; 3 a phase did
not finish (error or budget); 124 stopped by SIGTERM (the shell's timeout). Nothing here asserts a
time: budgets only decide how much is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable, Iterator, Optional

from ._common import quiet
from .gpu_phases import GPU, SMOKE, Phase, PhaseBudgetExceeded, Sizes, Stopped, progress

PHASES = ("env", "branches", "diagnose", "step")


# ---------------------------------------------------------------------------------------------
# Phase env


def logprob_kernel_verl_selects() -> str:
    """The kernel verl 0.9.1's ``logprobs_from_logits`` dispatches to in this process (torch_functional.py ~73)."""
    import verl.utils.torch_functional as verl_F

    if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1":
        return "logprobs_from_logits_flash_attn"
    if verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
        return "logprobs_from_logits_torch_npu"
    return "logprobs_from_logits_v2"


def _version(module_name: str) -> Optional[str]:
    try:
        module = __import__(module_name)
    except Exception as error:  # noqa: BLE001 - recorded, not raised
        return f"unavailable: {type(error).__name__}"
    return str(getattr(module, "__version__", "?"))


def _nccl_version() -> str:
    try:
        version = torch_nccl_version()
    except Exception as error:  # noqa: BLE001 - recorded, not raised
        return f"unavailable: {error!r}"
    return ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)


def torch_nccl_version():
    import torch

    return torch.cuda.nccl.version()


def phase_env(phase: Phase) -> None:
    import importlib.metadata
    import importlib.util
    import platform

    import torch

    import verl_klcov_global  # noqa: F401  (also loaded by VERL_USE_EXTERNAL_MODULES; idempotent)
    from verl_klcov_global.engine import patches
    from verl_klcov_global.lab.experiment import registered_global_modes, upstream_mode
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import ray

    data = phase.data
    data["python"] = platform.python_version()
    for name in ("torch", "transformers", "verl", "tensordict", "numpy", "accelerate"):
        data[name] = _version(name)
    data["ray"] = "stub (benchmarks/gpu_stubs/ray)" if getattr(ray, "STUB", False) else str(ray.__version__)
    data["torch_cuda"] = torch.version.cuda
    cuda = phase.device == "cuda"
    data["accelerator"] = torch.cuda.get_device_name(0) if cuda else None
    data["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None
    data["nccl"] = _nccl_version() if cuda else None
    data["cpu_count"] = os.cpu_count()
    data["flash_attn_installed"] = importlib.util.find_spec("flash_attn") is not None
    data["logprob_kernel_verl_selects"] = logprob_kernel_verl_selects()
    entry_points = sorted(ep.name for ep in importlib.metadata.entry_points(group="verl.plugins"))
    data["plugin_loaded_by"] = {
        "VERL_USE_EXTERNAL_MODULES": os.environ.get("VERL_USE_EXTERNAL_MODULES", ""),
        "entry_points_verl_plugins": entry_points,
        "explicit_import": True,
    }
    modes = registered_global_modes()
    data["global_modes"] = {
        mode: {"upstream": upstream_mode(mode), "upstream_registered": upstream_mode(mode) in POLICY_LOSS_REGISTRY}
        for mode in modes
    }
    for mode, info in data["global_modes"].items():
        if not info["upstream_registered"]:
            phase.note(f"{mode}: verl registers no {info['upstream']!r}; diagnose runs it against the control only "
                       "and the step phase has no ratio for it")
    phase.check("plugin registered and hook installed", "kl_cov_global" in modes and patches.is_hook_installed(),
                f"global modes {list(modes)}, hook installed {patches.is_hook_installed()}")


# ---------------------------------------------------------------------------------------------
# Phase diagnose


def phase_diagnose(phase: Phase) -> None:
    """diagnose (FSDP2) for every (dtype, global mode); fewer blocks when the budget is short."""
    from verl_klcov_global.diagnose.run import DiagnoseOptions, run_diagnose
    from verl_klcov_global.lab.experiment import registered_global_modes

    sizes = phase.sizes
    runs = [(dtype, mode) for dtype in ("fp32", "bf16") for mode in registered_global_modes()]
    per_block: Optional[float] = None
    for index, (dtype, mode) in enumerate(runs):
        blocks = sizes.diagnose_blocks
        if per_block is not None:  # leave the runs still to come at least one block each
            later = len(runs) - index - 1
            affordable = int((phase.remaining() - later * per_block) // per_block)
            if affordable < blocks:
                blocks = max(1, affordable)
                phase.note(f"{mode} {dtype}: {blocks} block(s) instead of {sizes.diagnose_blocks} (time budget)")
            phase.need(per_block, f"diagnose {mode} {dtype}")
        progress(f"  diagnose {mode} {dtype}: {blocks} block(s) on {phase.device}")
        options = DiagnoseOptions(
            device=phase.device, dtype=dtype, strategy="fsdp2", blocks=blocks, loss_mode=mode,
            batch_size=sizes.diagnose_batch, prompt_len=sizes.diagnose_prompt, response_len=sizes.diagnose_response,
            micro_batches=sizes.diagnose_micro_batches,
        )
        started = time.monotonic()
        report = run_diagnose(options, progress=lambda message: progress(f"    {message}"))
        per_block = (time.monotonic() - started) / blocks
        phase.data[f"{mode}/{dtype}"] = report
        phase.check(f"diagnose {mode} {dtype}", bool(report["invariant"]), report["verdict"])


# ---------------------------------------------------------------------------------------------
# Running the phases


def _phase_functions() -> dict[str, Callable[[Phase], None]]:
    from . import gpu_branches, gpu_step

    return {"env": phase_env, "branches": gpu_branches.run, "diagnose": phase_diagnose, "step": gpu_step.run}


def exit_status(report: dict) -> int:
    if any(check["ok"] is False for check in report["checks"]):
        return 1
    if not report["complete"]:
        return 3
    return 0


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_report(path: str, report: dict) -> None:
    """Atomic rewrite: a reader (or a kill) never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=folder, prefix=".gpu_check-", suffix=".json", delete=False)
    with handle:
        json.dump(_json_safe(report), handle, indent=2, allow_nan=False, default=str)
        handle.write("\n")
    os.replace(handle.name, path)


class _StopSignal:
    """SIGTERM handling: raise :class:`Stopped` only while a phase runs ("armed"); between phases
    (recording, writing the JSON) only remember it, and stop before the next phase."""

    def __init__(self):
        self.requested = False
        self.armed = False

    def __call__(self, signum, frame):
        self.requested = True
        if self.armed:
            self.armed = False
            progress("gpu_check: SIGTERM: stopping, writing the report")
            raise Stopped()

    @contextlib.contextmanager
    def armed_while(self) -> Iterator[None]:
        if self.requested:
            raise Stopped()
        self.armed = True
        try:
            yield
        finally:
            self.armed = False


def _run_phase(name: str, function: Callable[[Phase], None], phase: Phase,
               stop: _StopSignal) -> tuple[str, Optional[str]]:
    """Run one phase; returns (status, error): ok, incomplete (budget), stopped (SIGTERM) or error."""
    try:
        with stop.armed_while():
            progress(f"\n== phase {name} (budget {max(0.0, phase.remaining()):.0f} s) ==")
            if phase.remaining() < 5:
                raise PhaseBudgetExceeded("the phase's budget (or the overall budget) is spent")
            function(phase)
    except PhaseBudgetExceeded as exceeded:
        return "incomplete", f"time budget: {exceeded}"
    except Stopped:
        return "stopped", "SIGTERM (overall timeout) during this phase"
    except Exception:  # noqa: BLE001 - a broken phase is reported, the next one still runs
        return "error", traceback.format_exc(limit=12)
    return "ok", None


def run(args: argparse.Namespace) -> int:
    import torch

    from . import gpu_render

    sizes = SMOKE if args.smoke else GPU
    if args.budget is not None:
        sizes = Sizes(**{**asdict(sizes), "budget_seconds": args.budget})
    if args.phase_budget:
        sizes = Sizes(**{**asdict(sizes), "phase_budgets": {**sizes.phase_budgets, **args.phase_budget}})
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible. On a CPU machine run: bash scripts/gpu_check.sh --smoke",
              file=sys.stderr)
        return 2
    if args.smoke:
        torch.set_num_threads(1)  # CI's 2 cores are shared: more threads than free cores is much slower
    started = time.monotonic()
    final_deadline = started + sizes.budget_seconds
    report: dict[str, Any] = {
        "kit": "verl-klcov-global GPU validation kit (scripts/gpu_check.sh)",
        "smoke": args.smoke,
        "device": device,
        "command": " ".join(["bash scripts/gpu_check.sh", *sys.argv[1:]]),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_seconds": sizes.budget_seconds,
        "sizes": asdict(sizes),
        "phases": {},
        "checks": [],
        "complete": False,
    }
    stop = _StopSignal()
    signal.signal(signal.SIGTERM, stop)
    functions = _phase_functions()
    selected = [name for name in PHASES if name in (args.phases or PHASES)]
    with tempfile.TemporaryDirectory(prefix="verl_klcov_gpu_check_") as scratch:
        for name in selected:
            phase_started = time.monotonic()
            phase = Phase(name, device, sizes, scratch, min(phase_started + sizes.phase_budgets[name], final_deadline))
            status, error = _run_phase(name, functions[name], phase, stop)
            report["phases"][name] = {
                "status": status, "error": error, "seconds": round(time.monotonic() - phase_started, 1),
                "notes": phase.notes, **phase.data,
            }
            report["checks"] += [asdict(check) for check in phase.checks]
            report["seconds"] = round(time.monotonic() - started, 1)
            report["complete"] = all(report["phases"].get(p, {}).get("status") == "ok" for p in selected)
            report["exit_status"] = 124 if status == "stopped" else exit_status(report)
            write_report(args.json, report)
            if error:
                progress(f"  phase {name}: {status}: {error}")
            progress(gpu_render.phase_table(report, name))
            if status == "stopped" or stop.requested:
                report["exit_status"] = 124
                write_report(args.json, report)
                progress(f"stopped by SIGTERM; {args.json} holds the phases that finished")
                return 124
    progress("\n" + gpu_render.summary(report))
    progress(f"wrote {args.json}")
    return report["exit_status"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, same code (CI)")
    parser.add_argument("--json", help="report path (default out/gpu_check.json, smoke out/gpu_check_smoke.json)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, help="run only these phases (default: all)")
    parser.add_argument("--budget", type=float, help="overall time budget in seconds (default 400, smoke 270)")
    parser.add_argument("--phase-budget", action="append", default=[], metavar="PHASE=SECONDS",
                        help="one phase's time budget in seconds (repeatable); 0 skips the phase as out of budget")
    args = parser.parse_args(argv)
    budgets = {}
    for item in args.phase_budget:
        name, _, seconds = item.partition("=")
        if name not in PHASES:
            parser.error(f"--phase-budget {item!r}: the phase must be one of {PHASES}")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            parser.error(f"--phase-budget {item!r}: SECONDS must be a number")
    args.phase_budget = budgets
    if args.json is None:
        args.json = "out/gpu_check_smoke.json" if args.smoke else "out/gpu_check.json"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
