"""``verl-klcov-global diagnose``: the experiment of verl issue #7829 on the user's setup.

Runs :mod:`verl_klcov_global.experiment` for ``vanilla`` (the penalty-free
control), ``kl_cov`` and ``kl_cov_global`` over a few blocks and reports, per
mode, the tokens selected under each layout, whether the masks agree and the
largest parameter difference between the layouts relative to the control.
``DiagnoseOptions.loss_mode`` names another global mode of the plugin (compared
with its verl counterpart, the name without ``_global``, when verl registers it).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

INVARIANCE_FACTOR = 10.0  # kl_cov_global must stay within this many times the control's noise floor


class DiagnoseError(ValueError):
    """A bad option, reported before any work is done."""


@dataclass(frozen=True)
class DiagnoseOptions:
    model: Optional[str] = None
    device: Optional[str] = None
    dtype: str = "fp32"
    micro_batches: int = 8
    layout: str = "dynamic"
    blocks: int = 3
    seed: int = 0
    batch_size: int = 64
    prompt_len: int = 16
    response_len: int = 128
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    strategy: str = "fsdp"
    json_path: Optional[str] = None
    loss_mode: str = "kl_cov_global"


def validate(options: DiagnoseOptions) -> DiagnoseOptions:
    """Check every option up front; raise :class:`DiagnoseError` saying what to change."""
    from .config import validate_ppo_kl_coef
    from .selection import validate_kl_cov_ratio

    if options.model is not None:
        if not os.path.isdir(options.model):
            raise DiagnoseError(f"--model {options.model!r}: no such directory (give a local HF checkpoint folder)")
        if not os.path.isfile(os.path.join(options.model, "config.json")):
            raise DiagnoseError(f"--model {options.model!r}: no config.json there; is it a HF checkpoint folder?")
    if options.device not in (None, "cpu", "cuda"):
        raise DiagnoseError(f"--device must be cpu or cuda, got {options.device!r}")
    if options.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DiagnoseError("--device cuda: no CUDA device is visible; use --device cpu")
    if options.dtype not in ("fp32", "bf16"):
        raise DiagnoseError(f"--dtype must be fp32 or bf16, got {options.dtype!r}")
    from .experiment import registered_global_modes

    if options.loss_mode not in registered_global_modes():
        raise DiagnoseError(
            f"loss_mode {options.loss_mode!r} is not a mode this plugin registered; choose one of "
            f"{registered_global_modes()}"
        )
    if options.strategy not in ("fsdp", "fsdp2"):
        raise DiagnoseError(f"--strategy must be fsdp or fsdp2, got {options.strategy!r}")
    if options.blocks < 1:
        raise DiagnoseError(f"--blocks must be >= 1, got {options.blocks}")
    for name in ("batch_size", "prompt_len", "response_len"):
        if getattr(options, name) < 1:
            raise DiagnoseError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.micro_batches < 2:
        raise DiagnoseError(
            f"--micro-batches must be >= 2 (it is compared with 1 micro-batch), got {options.micro_batches}"
        )
    if options.micro_batches > options.batch_size:
        raise DiagnoseError(
            f"--micro-batches {options.micro_batches} cannot be formed from {options.batch_size} sequences: "
            "each micro-batch needs at least one sequence"
        )
    if options.layout not in ("dynamic", "static"):
        raise DiagnoseError(f"--layout must be dynamic or static, got {options.layout!r}")
    if options.layout == "static" and options.batch_size % options.micro_batches:
        raise DiagnoseError(
            f"--layout static needs --micro-batches to divide --batch-size ({options.batch_size}); "
            f"got {options.micro_batches}. Use --layout dynamic or another count"
        )
    try:
        validate_kl_cov_ratio(options.kl_cov_ratio)
        validate_ppo_kl_coef(options.ppo_kl_coef)
    except ValueError as error:
        raise DiagnoseError(str(error)) from None
    if options.json_path is not None:
        folder = os.path.dirname(os.path.abspath(options.json_path))
        if not os.path.isdir(folder):
            raise DiagnoseError(f"--json {options.json_path!r}: folder {folder!r} does not exist")
    return options


@contextlib.contextmanager
def quiet_verl() -> Iterator[None]:
    """Hide verl/transformers/torch chatter (prints, warnings, logs) while an engine works."""
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous)


def _progress(message: str) -> None:
    # the real stderr: quiet_verl() swaps sys.stderr while engines work
    print(message, file=sys.__stderr__, flush=True)


def run_diagnose(options: DiagnoseOptions, progress=_progress) -> dict:
    """Run the experiment; return the report (also written to ``options.json_path`` when set)."""
    import torch

    from . import _tiny
    from .config import KLCovGlobalPolicyLossConfig
    from .experiment import TRAIN_LAYOUT_MODE, EngineSpec, compared_modes, dynamic_layouts, frozen_minibatch
    from .experiment import run_block, static_layouts

    options = validate(options)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verl_klcov_diagnose_") as scratch:
        with quiet_verl():
            model_path = options.model or _tiny.build_tiny_model(os.path.join(scratch, "tiny"), seed=options.seed)
        vocab_size = _vocab_size(model_path)
        seq_len = options.prompt_len + options.response_len
        spec = EngineSpec(model_path, strategy=options.strategy, dtype=options.dtype, device=device,
                          infer_max_token_len_per_gpu=max(4096, seq_len))
        if options.layout == "dynamic":
            layouts = dynamic_layouts(options.batch_size, seq_len, options.micro_batches)
        else:
            layouts = static_layouts(options.batch_size, options.micro_batches)

        def actor_config_for(mode):
            if mode == TRAIN_LAYOUT_MODE:
                policy_loss = KLCovGlobalPolicyLossConfig(
                    kl_cov_ratio=options.kl_cov_ratio, ppo_kl_coef=options.ppo_kl_coef, prepass_layout="train"
                )
                return _tiny.make_actor_config(policy_loss=policy_loss)
            return _tiny.make_actor_config(
                loss_mode=mode, kl_cov_ratio=options.kl_cov_ratio, ppo_kl_coef=options.ppo_kl_coef
            )

        modes = compared_modes(options.loss_mode)
        updates = 2 * len(modes)

        blocks = []
        for block in range(options.blocks):
            seed = options.seed + block
            prefix = f"[block {block + 1}/{options.blocks}]"
            progress(f"{prefix} building the frozen minibatch (seed {seed})")
            with quiet_verl():
                batch = frozen_minibatch(
                    spec, seed, batch_size=options.batch_size, prompt_len=options.prompt_len,
                    response_len=options.response_len, vocab_size=vocab_size,
                )
            step = {"n": 0}

            def report_step(message, prefix=prefix, step=step):
                step["n"] += 1
                progress(f"{prefix} update {step['n']}/{updates}: {message}")

            with quiet_verl():
                results = run_block(spec, batch, layouts, actor_config_for, modes=modes, progress=report_step)
            blocks.append({mode: asdict(result) for mode, result in results.items()})
    report = summarise(options, device, [layout.name for layout in layouts], blocks)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if options.json_path:
        _write_json_atomically(options.json_path, report)
    return report


def _vocab_size(model_path: str) -> int:
    with open(os.path.join(model_path, "config.json")) as handle:
        return int(json.load(handle)["vocab_size"])


def summarise(options: DiagnoseOptions, device: str, layout_names: list[str], blocks: list[dict]) -> dict:
    """Per-mode figures over blocks, ratios to the control and the verdict."""
    modes = {}
    for mode in blocks[0]:
        diffs = [block[mode]["max_param_diff"] for block in blocks]
        controls = [block["vanilla"]["max_param_diff"] for block in blocks]
        ratios = [d / c if c > 0 else (0.0 if d == 0 else math.inf) for d, c in zip(diffs, controls)]
        masks = [block[mode]["masks_identical"] for block in blocks]
        modes[mode] = {
            "selected_per_layout": [block[mode]["selected_per_layout"] for block in blocks],
            "masks_identical": None if all(m is None for m in masks) else all(bool(m) for m in masks),
            "max_param_diff": diffs,
            "ratio_to_control": ratios,
        }
    from .experiment import upstream_mode

    global_ = modes[options.loss_mode]
    upstream = upstream_mode(options.loss_mode)
    invariant = bool(global_["masks_identical"]) and max(global_["ratio_to_control"]) <= INVARIANCE_FACTOR
    kl_cov_worst = max(modes[upstream]["ratio_to_control"]) if upstream in modes else None
    verdict = (
        f"{options.loss_mode} is {'INVARIANT' if invariant else 'NOT invariant'} to micro-batching: masks "
        f"{'identical' if global_['masks_identical'] else 'DIFFER'} in all {len(blocks)} blocks, "
        f"max|dtheta| up to {max(global_['ratio_to_control']):.2f}x the control's noise floor "
        f"(limit {INVARIANCE_FACTOR:g}x)"
    )
    if kl_cov_worst is not None:
        verdict += f"; {upstream} differs by up to {kl_cov_worst:.3g}x"
    return {
        "options": asdict(options),
        "device": device,
        "layouts": layout_names,
        "modes": modes,
        "invariant": invariant,
        "verdict": verdict,
    }


def format_report(report: dict) -> str:
    """The table a person reads at a glance."""
    options = report["options"]
    first, second = report["layouts"]
    lines = [
        f"model: {options['model'] or 'embedded tiny Qwen2 (built locally)'} | device {report['device']} | "
        f"{options['dtype']} | {options['strategy']} | {options['layout']} micro-batches",
        f"minibatch: {options['batch_size']} x ({options['prompt_len']} prompt + {options['response_len']} response) "
        f"tokens | kl_cov_ratio {options['kl_cov_ratio']} | ppo_kl_coef {options['ppo_kl_coef']} | "
        f"{len(report['modes']['vanilla']['max_param_diff'])} blocks | {report.get('seconds', '?')} s",
        "",
        f"{'mode':<29} {'tokens selected (' + first + ' | ' + second + ')':<44} {'masks':<10} "
        f"{'max|dtheta| between layouts':<30} ratio to control",
    ]
    for mode, figures in report["modes"].items():
        selected = ", ".join(f"{a} | {b}" for a, b in figures["selected_per_layout"])
        masks = {None: "-", True: "identical", False: "DIFFER"}[figures["masks_identical"]]
        diffs = ", ".join(f"{d:.1e}" for d in figures["max_param_diff"])
        ratios = ", ".join(f"{r:.2f}" if r < 10 else f"{r:.0f}" for r in figures["ratio_to_control"])
        lines.append(f"{mode:<29} {selected:<44} {masks:<10} {diffs:<30} {ratios}")
    lines += ["", ("OK: " if report["invariant"] else "FAIL: ") + report["verdict"]]
    return "\n".join(lines)


def _json_safe(value):
    """Non-finite floats as null: ``Infinity``/``NaN`` are not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _write_json_atomically(path: str, report: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    handle = tempfile.NamedTemporaryFile("w", dir=folder, prefix=".diagnose-", suffix=".json", delete=False)
    try:
        with handle:
            json.dump(_json_safe(report), handle, indent=2, allow_nan=False)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
