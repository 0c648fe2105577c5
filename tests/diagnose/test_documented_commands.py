"""Every ``diagnose`` command of docs/DIAGNOSE.md runs (verl's real FSDP engine on CPU, slow), and diagnose runs on any
minibatch size the training layouts accept (static and dynamic).

The commands are read from the doc's ``bash`` blocks and run in this process at a smaller size that keeps their
shape: one block, 8 sequences of 16 response tokens, 4 micro-batches, for every option the command leaves to
diagnose's defaults (an option it gives is kept), ``--max-tokens 512`` for a config; ``--model smollm2`` (400 s) is
the embedded tiny model's folder, whose tokenizer has a chat template, so its responses are sampled as SmolLM2's;
``--json`` writes under ``tmp_path``. The exit status is the one the doc states (``# exit N``, else 0). Commands that
name the reader's own files (``/path/to/your/configs``, ``my_losses``) are listed in :data:`READERS_OWN` and skipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

import pytest

from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseOptions, run_diagnose
from verl_klcov_global.lab.experiment import inference_micro_batch_size

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "DIAGNOSE.md")
#: The doc's commands that run the reader's own files: shown for their form, not runnable here.
READERS_OWN = ("/path/to/your/configs", "my_losses")
#: Options diagnose defaults to a size that takes minutes on CPU, and the size each command runs at here.
SMALL = {"--blocks": "1", "--batch-size": "8", "--response-len": "16", "--micro-batches": "4"}


def documented_commands() -> list[tuple[list[str], int]]:
    """``(arguments after 'diagnose', exit status the doc states)`` of every command in the doc's bash blocks."""
    with open(DOC) as handle:
        text = handle.read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if "verl-klcov-global diagnose" not in line:
                continue
            command, _, comment = line.partition("#")
            expected = re.search(r"exit (\d)", comment)
            words = shlex.split(command)
            commands.append((words[words.index("diagnose") + 1:], int(expected.group(1)) if expected else 0))
    return commands


def _runnable(args: list[str], tmp_path, tiny_model_path) -> list[str]:
    out, index = [], 0
    while index < len(args):
        word = args[index]
        if word == "--model" and args[index + 1] == "smollm2":
            out += ["--model", tiny_model_path]
            index += 2
            continue
        if word == "--json":
            out += ["--json", str(tmp_path / os.path.basename(args[index + 1]))]
            index += 2
            continue
        out.append(word)
        index += 1
    if "--config-name" in out:
        return out + [arg for flag in ("--blocks", "--max-tokens") if flag not in out
                      for arg in (flag, SMALL.get(flag, "512"))]
    return out + [arg for flag, value in SMALL.items() if flag not in out for arg in (flag, value)]


@pytest.fixture
def restore_sys_path(monkeypatch):
    """diagnose puts the current directory on sys.path (as python -m does): undo it after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_the_doc_has_the_commands_this_test_runs():
    commands = documented_commands()
    own = [args for args, _ in commands if any(word in args for word in READERS_OWN)]
    assert len(own) == 2  # the reader's config, the reader's loss module
    runnable = [args for args, _ in commands if args not in own]
    assert any(args[:2] == ["--model", "smollm2"] and "static" in args for args in runnable)  # the real model's
    assert {"--all-registered", "--config-name"} <= {word for args in runnable for word in args}
    assert {status for _, status in commands} == {0, 1}


@pytest.mark.slow  # verl's engine on CPU: every command at 8 x (16 + 16) tokens, one block; about a minute
def test_every_documented_command_runs_with_the_exit_status_the_doc_states(tmp_path, tiny_model_path, monkeypatch,
                                                                           capfd, restore_sys_path):
    monkeypatch.chdir(os.path.join(os.path.dirname(DOC), ".."))  # the doc's commands run from a checkout's root
    ran, own = [], []
    for args, expected in documented_commands():
        if any(word in args for word in READERS_OWN):
            own.append(args)
            continue
        argv = _runnable(args, tmp_path, tiny_model_path)
        code = cli.main(["diagnose", *argv])
        out, err = capfd.readouterr()
        assert code == expected, (f"diagnose {' '.join(argv)}: exit {code}, the doc says {expected}\n{out}\n"
                                  f"{err[-3000:]}")
        assert out.rstrip().splitlines()[-1].startswith("verdict: ")
        ran.append(argv)
    # the real model's command, on the tiny model's folder: every mode, static, sampled responses
    real_model = json.loads((tmp_path / "diagnose_smollm2.json").read_text())
    assert real_model["options"]["layout"] == "static" and real_model["responses"]["kind"] == "sampled"
    assert len(real_model["verdicts"]) == 5 and real_model["invariant"] is True
    assert len(ran) == len(documented_commands()) - len(own) >= 8


def test_the_log_prob_pass_takes_a_micro_batch_size_that_divides_the_rows():
    assert inference_micro_batch_size(64, 16) == 16  # the default run: unchanged
    assert inference_micro_batch_size(8, 16) == 8
    assert inference_micro_batch_size(12, 16) == 12
    assert inference_micro_batch_size(24, 16) == 12
    assert inference_micro_batch_size(7, 4) == 1
    assert inference_micro_batch_size(6, None) == 6


@pytest.mark.slow  # verl's engine on CPU: 6 updates of 8 x (16 + 16) tokens per case
@pytest.mark.parametrize("mode, batch_size, micro_batches", [
    ("stare_global", 8, 4),  # verl's pass at 16 sequences per micro-batch asserted on 8 sequences (exit 2)
    ("lp_reg_global", 8, 4),
    ("lp_reg_global", 6, 3),  # a size no power of two divides past 2
])
def test_a_static_minibatch_smaller_than_the_inference_micro_batch_runs(mode, batch_size, micro_batches):
    report = run_diagnose(DiagnoseOptions(loss_mode=mode, blocks=1, layout="static", batch_size=batch_size,
                                          micro_batches=micro_batches, response_len=16),
                          progress=lambda message: None)
    assert report["invariant"] is True and report["verdicts"][mode].startswith(f"{mode} is INVARIANT")
    figures = report["modes"][mode]
    assert figures["masks_identical"] is True
    assert report["layouts"] == ["1 micro-batch", f"{micro_batches} micro-batches"]
