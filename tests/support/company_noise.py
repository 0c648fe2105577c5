"""Emulate a CPU whose fp32 results for a row depend on the rows beside it in a micro-batch (test-only).

On the AMD EPYC runners (AVX2 and AVX512) a row's fp32 log-probs from verl's FSDP engine move in the last bits
(about 5e-7) with the other rows of its micro-batch; on the Intel Xeons seen they did not. A test that compares
floats, or masks made from floats, across micro-batch layouts, DP splits or Ulysses shards can pass on one kind
and fail on the other. With ``VERL_KLCOV_EMULATE_COMPANY_NOISE=1`` every process of the suite (the xdist workers,
:func:`tests.support.gloo.spawn_gloo`'s ranks, the Ray processes of the trainer tests) perturbs the logits of every
causal-LM forward by a relative 2^-22 (about 2 ulp; the gradient through them alike) in a pattern drawn from a
digest of the whole call's ``input_ids``: the same micro-batch gives the same logits (the same computation on the same inputs stays bit for
bit), the same row in other company gives other last bits, on any CPU. So the suite can be run here as it would
run on such a CPU::

    VERL_KLCOV_EMULATE_COMPANY_NOISE=1 .venv/bin/python -m pytest -q

It changes nothing unless that variable is set, and nothing outside the tests imports it.
"""

from __future__ import annotations

import hashlib
import os

ENV = "VERL_KLCOV_EMULATE_COMPANY_NOISE"
RELATIVE = 2.0 ** -22
_HANDLE = None


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def install_if_requested() -> bool:
    """Installs the emulation in this process when :data:`ENV` is set (idempotent); whether it is installed."""
    global _HANDLE
    if not requested():
        return False
    if _HANDLE is None:
        import torch

        _HANDLE = torch.nn.modules.module.register_module_forward_hook(_perturb_logits, with_kwargs=True)
    return True


def _perturb_logits(module, args, kwargs, output):
    if not type(module).__name__.endswith("ForCausalLM") or getattr(output, "logits", None) is None:
        return None
    import torch

    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None:
        return None
    company = hashlib.blake2b(input_ids.detach().cpu().contiguous().numpy().tobytes()
                              + str(tuple(input_ids.shape)).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(company, "little") & (2**63 - 1))
    logits = output.logits
    signs = torch.randint(-1, 2, logits.shape, generator=generator).to(device=logits.device, dtype=logits.dtype)
    output.logits = logits * (1 + RELATIVE * signs)  # the gradient through the logits follows the company too
    return output
