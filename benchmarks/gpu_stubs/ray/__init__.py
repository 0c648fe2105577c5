"""A stand-in for Ray on the GPU check machine, which has no Ray (its wheel alone is about the 64 MiB
that may travel there).

verl 0.9.1 imports Ray when ``import verl`` runs (``verl/protocol.py``: ``import ray``, and the class
annotation ``futures: list[ray.ObjectRef]`` of ``DataProtoFuture``), but the path of
``scripts/gpu_check.sh`` -- verl's FSDP engine built in one process, world size 1, NCCL -- never calls
Ray. This module provides ``ObjectRef`` for that annotation and nothing else: any other attribute
raises an ``AttributeError`` that says so, so a code path that does need Ray fails loudly instead of
running against a fake. It has no dist-info, so libraries that probe for an installed Ray
(``importlib.metadata``) still see none.

``scripts/gpu_check.sh`` puts ``benchmarks/gpu_stubs`` on ``PYTHONPATH`` only when ``import ray``
finds no real Ray; ``benchmarks.gpu_check`` records which one ran (``env.ray``).
"""

STUB = True
__version__ = "0+verl-klcov-global-gpu-kit-stub"


class ObjectRef:
    """Type-annotation placeholder for ``ray.ObjectRef``; never instantiated on the kit's path."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("ray.ObjectRef of the GPU kit's Ray stub was instantiated: this path needs a real Ray")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"ray.{name}: Ray is a stub on this machine (benchmarks/gpu_stubs/ray, put on the path by "
        "scripts/gpu_check.sh because no Ray is installed); the GPU check's path must not need Ray"
    )
