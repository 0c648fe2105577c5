import os
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
warnings.filterwarnings("ignore", message=".*engine is not available.*")


import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A random tiny Qwen2 + tokenizer built locally (no hub), shared by the engine tests."""
    from verl_klcov_global.lab.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))
