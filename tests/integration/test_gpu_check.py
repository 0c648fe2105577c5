"""The GPU validation kit (scripts/gpu_check.sh) runs, in its CPU smoke, the code the GPU run runs.

The smoke is the same program with tiny sizes on CPU (gloo instead of NCCL): every phase must
finish, every check that applies to a CPU must pass, and exactly the accelerator-only checks are
reported as not applicable. One smoke serves the module's slow tests; the module took 80 s on the
2 shared cores here (load average ~6), the budget and SIGTERM tests ~25 s of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # verl's real engine / workers / trainer on CPU: the slow tier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACCELERATOR_ONLY = {
    "device RNG restored", "accelerator logits path", "selection over the NCCL group",
    "prepass peak <= verl's own peak",
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_check") / "smoke.json"
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke", "--json", str(path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout[-6000:], result.stderr[-3000:])
    return json.loads(path.read_text()), result.stdout, path


@pytest.mark.slow
def test_smoke_finishes_every_phase_and_passes_every_cpu_check(smoke):
    report, stdout, _ = smoke
    assert report["device"] == "cpu" and report["smoke"] is True
    assert {name: phase["status"] for name, phase in report["phases"].items()} == {
        "env": "ok", "branches": "ok", "diagnose": "ok", "step": "ok"}
    assert report["complete"] is True and report["exit_status"] == 0
    by_name = {check["name"]: check for check in report["checks"]}
    assert {name for name, check in by_name.items() if check["ok"] is None} == ACCELERATOR_ONLY
    assert all(check["ok"] is True for name, check in by_name.items() if name not in ACCELERATOR_ONLY)
    for name in ("process group", "CPU RNG restored", "CPU logits path", "prepass deterministic",
                 "prepass = compute_log_prob", "selection over the gloo group", "several micro-batches"):
        assert by_name[name]["ok"] is True, by_name.get(name)
    assert "ALL CHECKS PASSED" in stdout


@pytest.mark.slow
def test_smoke_runs_diagnose_for_every_registered_global_mode_in_both_dtypes(smoke):
    from verl_klcov_global.lab.experiment import registered_global_modes

    report, _, _ = smoke
    diagnose = report["phases"]["diagnose"]
    modes = registered_global_modes()
    assert "kl_cov_global" in modes
    for mode in modes:
        for dtype in ("fp32", "bf16"):
            run = diagnose[f"{mode}/{dtype}"]
            assert run["invariant"] is True, run["verdict"]
            assert run["options"]["device"] == "cpu" and run["options"]["strategy"] == "fsdp2"
            assert run["modes"][mode]["masks_identical"] is True


@pytest.mark.slow
def test_smoke_step_measures_the_same_quantities_as_the_gpu_run(smoke):
    report, _, _ = smoke
    step = report["phases"]["step"]
    assert step["timed_rounds"] >= 1 and step["figures_from"].startswith("timed")
    for name in ("compute_log_prob", "prepass", "step kl_cov", "step kl_cov_global"):
        assert step["median_seconds"][name] > 0
    assert step["ratios"]["kl_cov_global/kl_cov seconds"] > 0
    assert len(step["minibatch"]["train_micro_batch_tokens"]) > 1
    assert set(step["loss_calls_per_step"].values()) == {len(step["minibatch"]["train_micro_batch_tokens"])}
    assert step["engine"]["use_remove_padding"] and step["engine"]["use_dynamic_bsz"]
    assert step["attention"]["attn_implementation"] == "sdpa"
    assert any("scaled_dot_product" in op for op in step["attention"]["prepass_aten_ops"])
    assert step["logprob_calls"]["step kl_cov"] == {"logprobs_from_logits_v2": 4}
    # bf16 logits: the prepass keeps verl's row loop (the plugin's batched path takes fp32 only)
    assert step["logprob_calls"]["prepass"] == {"logprobs_from_logits_v2": 2}
    assert set(step["hook_metrics"]["kl_cov_global"]) == {"prepass_seconds", "selection_seconds", "prepass_share"}
    assert step["peak_gib"] == {}  # no allocator statistics on CPU: nothing is made up


@pytest.mark.slow
def test_render_fills_only_the_gpu_section_and_refuses_cpu_reports_by_default(smoke, tmp_path):
    from benchmarks import gpu_render

    report, _, path = smoke
    with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as handle:
        original = handle.read()
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(original)
    assert gpu_render.main([str(path), "--doc", str(doc)]) == 2  # a CPU report is not GPU evidence
    assert doc.read_text() == original
    assert gpu_render.main([str(path), "--doc", str(doc), "--allow-cpu"]) == 0
    rendered = doc.read_text()
    before, _, rest = original.partition(gpu_render.BEGIN)
    _, _, after = rest.partition(gpu_render.END)
    assert rendered.startswith(before) and rendered.endswith(after)
    section = rendered[len(before):len(rendered) - len(after)]
    ratio = report["phases"]["step"]["ratios"]["kl_cov_global/kl_cov seconds"]
    assert f"{ratio:.3g}" in section and "INVARIANT" in section and "selection over the gloo group" in section


def test_docs_carry_one_gpu_section_to_fill():
    from benchmarks import gpu_render

    with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as handle:
        text = handle.read()
    assert text.count(gpu_render.BEGIN) == 1 and text.count(gpu_render.END) == 1
    assert text.index(gpu_render.BEGIN) < text.index(gpu_render.END)


def test_ray_stub_provides_only_the_annotation_and_fails_loudly_otherwise():
    spec = importlib.util.spec_from_file_location(
        "gpu_kit_ray_stub", os.path.join(ROOT, "benchmarks", "gpu_stubs", "ray", "__init__.py"))
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    assert stub.STUB is True and isinstance(stub.ObjectRef, type)
    with pytest.raises(RuntimeError, match="needs a real Ray"):
        stub.ObjectRef()
    with pytest.raises(AttributeError, match="Ray is a stub"):
        stub.get  # noqa: B018
    assert not hasattr(stub, "init")


def _kit_env() -> dict:
    path = os.pathsep.join([os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "VERL_USE_EXTERNAL_MODULES": "verl_klcov_global"}


@pytest.mark.slow
def test_a_spent_budget_leaves_a_report_of_the_phases_that_finished(tmp_path):
    """~10 s: env runs (it checks no budget), branches gets a zero budget, so it is out of budget by construction,
    on any machine; exit status 3, the JSON says which phase did not run."""
    path = tmp_path / "partial.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--phases", "env", "branches",
         "--phase-budget", "branches=0", "--json", str(path)], cwd=ROOT, env=_kit_env(), capture_output=True,
        text=True, timeout=600)
    assert result.returncode == 3, result.stdout[-3000:]
    report = json.loads(path.read_text())
    assert report["phases"]["env"]["status"] == "ok"
    assert report["phases"]["branches"]["status"] == "incomplete"
    assert "budget" in report["phases"]["branches"]["error"]
    assert report["complete"] is False and report["exit_status"] == 3


@pytest.mark.slow
def test_sigterm_writes_the_report_and_exits_124(tmp_path):
    """~20 s: the shell's timeout sends SIGTERM; the phase in progress is recorded as stopped."""
    import signal

    path = tmp_path / "stopped.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--phases", "env", "branches", "--json", str(path)],
        cwd=ROOT, env=_kit_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if line.startswith("== phase branches"):
                process.send_signal(signal.SIGTERM)
                break
        output = process.communicate(timeout=300)[0]
    finally:
        process.kill()
    assert process.returncode == 124, output[-3000:]
    report = json.loads(path.read_text())
    assert report["phases"]["env"]["status"] == "ok"
    assert report["phases"]["branches"]["status"] == "stopped" and report["exit_status"] == 124
