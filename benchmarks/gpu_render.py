"""Tables of the GPU kit's report, for the terminal and for docs/BENCHMARKS.md.

    python -m benchmarks.gpu_render out/gpu_check.json                 # fill the GPU section of docs/BENCHMARKS.md
    python -m benchmarks.gpu_render out/gpu_check.json --doc OTHER.md  # another document with the same markers
    python -m benchmarks.gpu_render out/gpu_check.json --print         # print the section only

The section lies between ``BEGIN`` and ``END`` (HTML comments) and is replaced whole; every figure
in it comes from the JSON. A CPU smoke report is refused unless ``--allow-cpu`` (tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from ._common import table as _table

BEGIN = "<!-- gpu-check:begin (rendered from the kit's JSON by `python -m benchmarks.gpu_render`; do not edit) -->"
END = "<!-- gpu-check:end -->"
MARK = {True: "ok", False: "FAIL", None: "n/a"}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table whose cells may contain ``|`` (verdicts say max|dtheta|)."""

    def escape(value: Any) -> Any:
        return value.replace("|", "\\|") if isinstance(value, str) else value

    return _table([escape(h) for h in headers], [[escape(v) for v in row] for row in rows])


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def checks_table(report: dict, phase: Optional[str] = None) -> str:
    rows = [[c["phase"], c["name"], MARK[c["ok"]], c["detail"]] for c in report["checks"]
            if phase is None or c["phase"] == phase]
    return table(["phase", "check", "result", "detail"], rows) if rows else "(no checks)"


def env_table(env: dict) -> str:
    keys = ["accelerator", "compute_capability", "python", "torch", "torch_cuda", "nccl", "transformers", "verl",
            "tensordict", "numpy", "ray", "flash_attn_installed", "logprob_kernel_verl_selects"]
    rows = [[key, _fmt(env.get(key))] for key in keys if key in env]
    loaded = env.get("plugin_loaded_by", {})
    rows.append(["plugin loaded by", f"VERL_USE_EXTERNAL_MODULES={loaded.get('VERL_USE_EXTERNAL_MODULES', '')!r}, "
                 f"entry points {loaded.get('entry_points_verl_plugins', [])}, explicit import"])
    rows.append(["global loss modes", ", ".join(
        f"{mode} (verl {info['upstream']}: {'registered' if info['upstream_registered'] else 'MISSING'})"
        for mode, info in env.get("global_modes", {}).items())])
    return table(["", "value"], rows)


def diagnose_table(diagnose: dict) -> str:
    rows = []
    for key, report in diagnose.items():
        if "/" not in key or not isinstance(report, dict) or "modes" not in report:
            continue
        mode, dtype = key.split("/")
        figures = report["modes"]
        upstream = mode.removesuffix("_global")
        ratios = figures[mode]["ratio_to_control"]
        up = figures.get(upstream, {}).get("ratio_to_control")
        rows.append([
            mode, dtype, len(ratios),
            {None: "-", True: "identical", False: "DIFFER"}[figures[mode]["masks_identical"]],
            ", ".join(f"{r:.2f}" for r in ratios),
            ", ".join(f"{r:.3g}" for r in up) if up else "-",
            # a mode whose rows ran on diagnose's peaked policy has its own control (report["controls"])
            ", ".join(f"{d:.1e}" for d in figures[report.get("controls", {}).get(mode, "vanilla")]["max_param_diff"]),
            "INVARIANT" if report["invariant"] else "NOT invariant", report.get("seconds"),
        ])
    return table(["mode", "dtype", "blocks", "masks (1 vs N micro-batches)", "max|dθ| / control",
                  "verl mode / control", "control max|dθ|", "verdict", "s"], rows) if rows else "(no diagnose run)"


def step_tables(step: dict) -> str:
    if "median_seconds" not in step:
        return "(no step figures)"
    med, peak = step["median_seconds"], step.get("peak_gib", {})
    reference = med.get("compute_log_prob")
    rows = [[name, med[name], _fmt(peak.get(name)), _fmt(med[name] / reference if reference else None),
             len(step["samples_seconds"].get(name, []))] for name in med]
    ops = table(["operation", "seconds", "peak GiB", "/ compute_log_prob", "timed runs"], rows)
    ratios = table(["ratio", "value"], [[k, _fmt(v)] for k, v in step.get("ratios", {}).items()])
    mb = step.get("minibatch", {})
    model, engine = step.get("model", {}), step.get("engine", {})
    config = model.get("config", {})
    shape = (f"{model.get('name')}: hidden {config.get('hidden_size')}, {config.get('num_hidden_layers')} layers, "
             f"{config.get('num_attention_heads')}/{config.get('num_key_value_heads')} heads, vocab "
             f"{config.get('vocab_size')}, {engine.get('parameters', 0):,} parameters; {engine.get('strategy')}, "
             f"{engine.get('compute')}, {engine.get('optimizer')}, gradient checkpointing, remove-padding, dynamic "
             f"batching (ppo/log-prob max tokens per GPU {engine.get('ppo_max_token_len_per_gpu')}/"
             f"{engine.get('log_prob_max_token_len_per_gpu')})")
    batch = (f"minibatch: {mb.get('sequences')} sequences, {mb.get('tokens', 0):,} tokens (responses "
             f"{mb.get('response_len_min')}-{mb.get('response_len_max')}); training micro-batches "
             f"{mb.get('train_micro_batch_tokens')}, log-prob micro-batches {mb.get('infer_micro_batch_tokens')} "
             f"tokens; figures from {step.get('figures_from')}, {step.get('timed_rounds')} timed round(s)")
    attention = step.get("attention", {})
    kernels = (f"attention: {attention.get('attn_implementation')}; aten ops in a profiled prepass: "
               f"{attention.get('prepass_aten_ops')}; log-prob function calls per operation (verl's kernels and "
               f"the plugin's batched path): {step.get('logprob_calls')}; the hook's own metrics in the steps "
               f"(medians): {step.get('hook_metrics')}")
    return "\n\n".join([shape, batch, ops, ratios, kernels])


def phase_table(report: dict, name: str) -> str:
    phase = report["phases"].get(name, {})
    parts = [f"-- {name}: {phase.get('status')} in {phase.get('seconds')} s"]
    if name == "env":
        parts.append(env_table(phase))
    elif name == "diagnose":
        parts.append(diagnose_table(phase))
    elif name == "step":
        parts.append(step_tables(phase))
    parts.append(checks_table(report, name))
    return "\n".join(parts)


def summary(report: dict) -> str:
    phases = ", ".join(f"{name} {p['status']} ({p['seconds']} s)" for name, p in report["phases"].items())
    failed = [c for c in report["checks"] if c["ok"] is False]
    verdict = ("ALL CHECKS PASSED" if report["exit_status"] == 0 else
               f"{len(failed)} CHECK(S) FAILED" if failed else "INCOMPLETE: a phase did not finish")
    return "\n".join([f"== gpu_check on {report['device']}: {verdict} in {report.get('seconds')} s", phases,
                      checks_table(report)])


def render_section(report: dict) -> str:
    """The Markdown that replaces the GPU section of docs/BENCHMARKS.md."""
    phases = report["phases"]
    env = phases.get("env", {})
    lines = [
        BEGIN,
        f"Rendered from the kit's report of a run on {env.get('accelerator') or report['device']} "
        f"({report['started_utc']}, `{report['command']}`, {report.get('seconds')} s, exit status "
        f"{report['exit_status']}; phases: "
        + ", ".join(f"{name} {p['status']}" for name, p in phases.items()) + ").",
        "",
        "### Environment", "", env_table(env) if env else "(env phase missing)", "",
        "### Checks", "", checks_table(report), "",
        "### diagnose on the accelerator (tiny model, FSDP2, 1 vs N dynamic micro-batches)", "",
        diagnose_table(phases.get("diagnose", {})), "",
        "### Step time and peak memory at a realistic shape", "", step_tables(phases.get("step", {})),
    ]
    notes = [f"- {name}: {note}" for name, p in phases.items() for note in p.get("notes", [])]
    errors = [f"- {name}: {p['status']}: {str(p['error']).strip().splitlines()[-1]}" for name, p in phases.items()
              if p.get("error")]
    if notes or errors:
        lines += ["", "Notes:", ""] + notes + errors
    lines.append(END)
    return "\n".join(lines)


def replace_section(document: str, section: str) -> str:
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document has no GPU section: add the lines\n{BEGIN}\n{END}\nwhere it belongs")
    return document[:start] + section + document[end + len(END):]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_render", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="the kit's JSON (out/gpu_check.json)")
    parser.add_argument("--doc", default="docs/BENCHMARKS.md")
    parser.add_argument("--print", action="store_true", help="print the section instead of writing the document")
    parser.add_argument("--allow-cpu", action="store_true", help="accept a CPU (smoke) report (tests only)")
    args = parser.parse_args(argv)
    with open(args.report) as handle:
        report = json.load(handle)
    if report.get("device") != "cuda" and not args.allow_cpu:
        print(f"gpu_render: {args.report} is a {report.get('device')} run (smoke?), not a GPU run; "
              "the GPU section takes GPU figures only", file=sys.stderr)
        return 2
    section = render_section(report)
    if args.print:
        print(section)
        return 0
    with open(args.doc) as handle:
        document = handle.read()
    with open(args.doc, "w") as handle:
        handle.write(replace_section(document, section))
    print(f"gpu_render: wrote the GPU section of {args.doc} from {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
