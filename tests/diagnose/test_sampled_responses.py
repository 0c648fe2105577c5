"""``diagnose`` on a model's own responses (``--responses``, lab/sampling.py).

Fast: what ``auto`` means, and the exit-2 cases. Slow: ``--model`` with the tiny Qwen2's folder (its tokenizer has a
chat template), one block, kl_cov_global: the minibatch is sampled, the report says how, and the verdict stands.
"""

from __future__ import annotations

import json
import os

import pytest

import torch

from verl_klcov_global import cli
from verl_klcov_global.diagnose.run import DiagnoseOptions, format_report, responses_of, sampled_dynamic_layouts
from verl_klcov_global.lab.sampling import SampledBatch


def _no_template_folder(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 512}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    return str(folder)


def test_auto_samples_a_chat_models_responses_and_keeps_random_ids_otherwise(tmp_path, tiny_model_path):
    assert responses_of(DiagnoseOptions()) == "random"  # the embedded tiny model, as before
    assert responses_of(DiagnoseOptions(model=tiny_model_path)) == "sampled"  # its tokenizer has a chat template
    assert responses_of(DiagnoseOptions(model=_no_template_folder(tmp_path))) == "random"
    assert responses_of(DiagnoseOptions(model=tiny_model_path, responses="random")) == "random"


@pytest.mark.parametrize("argv, message", [
    (["--responses", "sampled"], "--responses sampled needs --model"),
    (["--responses", "sampled", "--model", "PLAIN"], "has no chat template"),
    (["--model", "TINY", "--batch-size", "10"], "multiple of --samples-per-prompt 4"),
    (["--model", "TINY", "--temperature", "0"], "--temperature must be > 0"),
])
def test_bad_sampling_options_exit_2_with_what_to_change(argv, message, tmp_path, tiny_model_path, capsys):
    names = {"PLAIN": _no_template_folder(tmp_path), "TINY": tiny_model_path}
    argv = [names.get(arg, arg) for arg in argv]
    assert cli.main(["diagnose", *argv]) == 2
    assert message in capsys.readouterr().err


def test_config_runs_keep_random_ids_and_refuse_the_sampling_options(capsys):
    assert cli.main(["diagnose", "--config-name", "kl_cov_global", "--responses", "sampled", "--temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "--responses does not combine with --config-name" in err and "--temperature does not combine" in err


def _rows(response_lengths, prompt=5, width=10):
    lengths = torch.tensor(response_lengths)
    response_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rows = len(response_lengths)
    return SampledBatch(prompts=torch.ones(rows, prompt, dtype=torch.long), prompt_mask=torch.ones(rows, prompt,
                        dtype=torch.long), responses=response_mask, response_mask=response_mask,
                        entropies=torch.zeros(rows, width), pad_token_id=0, eos_token_id=2, temperature=1.0)


def test_dynamic_budgets_follow_the_sampled_lengths_and_name_the_count_verl_forms():
    options = DiagnoseOptions(batch_size=8, micro_batches=4)
    # block 1: 8 rows of 5 + 10 tokens (120); block 2: 8 rows of 5 + 1 (48). Budget max(15, ceil(120 / 4)) = 30:
    # verl forms ceil(120 / 30) = 4 micro-batches of block 1 and ceil(48 / 30) = 2 of block 2
    whole, split = sampled_dynamic_layouts(options, [_rows([10] * 8), _rows([1] * 8)])
    assert whole.max_token_len_per_gpu == 120 and split.max_token_len_per_gpu == 30
    assert split.name == "2-4 micro-batches (30-token budget)"
    (_, alone) = sampled_dynamic_layouts(options, [_rows([10] * 8)])
    assert alone.name == "4 micro-batches (30-token budget)"
    (_, long_rows) = sampled_dynamic_layouts(DiagnoseOptions(batch_size=8, micro_batches=8), [_rows([10] * 2 + [1] * 6)])
    assert long_rows.max_token_len_per_gpu == 15  # never below the longest row (verl asserts it)


@pytest.mark.slow
def test_diagnose_samples_the_models_own_responses(tiny_model_path, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    status = cli.main(["diagnose", "--model", tiny_model_path, "--loss-mode", "kl_cov_global", "--blocks", "1",
                       "--batch-size", "8", "--response-len", "12", "--micro-batches", "4", "--layout", "static",
                       "--kl-cov-ratio", "0.02", "--json", str(report_path)])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert status == 0, out
    responses = report["responses"]
    assert responses["kind"] == "sampled" and responses["samples_per_prompt"] == 4
    (block,) = responses["blocks"]
    assert 0 < block["response_tokens"] <= 8 * 12 and block["response_width"] <= 12
    assert "responses sampled from the model (2 arithmetic prompts x 4" in out
    assert report["modes"]["kl_cov_global"]["masks_identical"] is True
    assert os.path.basename(report["options"]["model"]) == os.path.basename(tiny_model_path)
    assert format_report(report) in out
