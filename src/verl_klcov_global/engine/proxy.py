"""Lp-Reg's proxy: log pi_proxy(y_t) of each sampled token, computed inside verl's log-prob pass from its logits.

The proxy (Lp-Reg, arXiv:2510.03222, section 3) is the old policy's next-token distribution with every token of
probability below ``kappa * max p`` removed and the rest renormalised (a min-p filter). Only its log-prob of the
sampled token is needed. It must be the old policy's, so it is computed in verl's own log-prob pass
(``compute_log_prob``, the parameters pi_old), in PATCH ``proxy_log_prob_in_pass`` (:mod:`.patches`): a wrapper
of ``FSDPEngineWithLMHead.prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func)``
(the verl code it targets, by version, is in the patch catalogue), which reads
``output.logits`` before verl's own code (which may scale them in place by the temperature) and adds
:data:`PROXY_OUTPUT_KEY` to the model output. verl's ``postprocess_batch_func`` concatenates every model-output key
of the micro-batches and undoes dynamic batching's reordering, so the key arrives per row like ``log_probs``;
:func:`.kept_pass.after_infer_batch` keeps it for the update and removes it from what verl returns.

It runs only where the micro-batch carries the non-tensor key :data:`PROXY_REQUEST_KEY` (the min-p threshold
kappa), set by PATCH ``log_prob_pass_context`` for the pass of an actor whose loss is ``lp_reg_global``.

**The formula.** With ``z`` the untempered logits of one position, ``T`` its temperature and ``u = z / T``:
the support is ``S = {v : z_v >= max z + ln kappa}`` (the authors' ``apply_min_p``: ``softmax(z)_v >= kappa *
max softmax(z)``, on the untempered logits, before their division by ``T``; the two tests agree in exact
arithmetic, and a float at the boundary may fall either way), and ``log pi_proxy(y) = u_y - logsumexp_{v in S} u_v``
for ``y`` in ``S``, ``-inf`` for ``y`` outside it (the authors' code gives such a token the logit ``-1e4``: a
log-prob near ``-1e4 / T``; either way ``log pi_theta(y) < log pi_proxy(y)`` never holds there, so it is never
regularised). verl hands this code the untempered logits, so the formula is exact at any temperature: no
conversion and no refusal is needed at ``T != 1``.

**Cost.** fp32, in row chunks of :data:`CHUNK_ROWS` positions: a ``(chunk, vocab)`` fp32 copy of the logits, its
support mask and the scaled logits live at once (about ``9 * chunk * vocab`` bytes); out: 4 bytes per token. Time:
one max, one masked logsumexp and one gather over the vocabulary per position (docs/LP_REG.md and
docs/BENCHMARKS.md: what that costs). ``use_fused_kernels`` has no logits and is refused, as verl refuses
``calculate_sum_pi_squared`` there.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["CHUNK_ROWS", "PROXY_OUTPUT_KEY", "PROXY_REQUEST_KEY", "ProxyUnsupportedError",
           "prepare_model_outputs_with_proxy", "proxy_log_probs_from_logits"]

#: Non-tensor key of a micro-batch: the min-p threshold kappa; present = compute the proxy in this forward.
PROXY_REQUEST_KEY = "verl_klcov_global_proxy_min_p"
#: Model-output key of the proxy's log-probs (nested per row, like ``log_probs``), removed before verl returns.
PROXY_OUTPUT_KEY = "verl_klcov_global_proxy_log_probs"
#: Positions per chunk of the full-vocabulary work.
CHUNK_ROWS = 256


class ProxyUnsupportedError(NotImplementedError):
    """The forward has no logits to compute Lp-Reg's proxy from (``use_fused_kernels``), or a layout not covered."""


def proxy_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: Any, min_p: float,
                                chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """log pi_proxy of ``labels`` under the min-p-filtered, temperature-scaled softmax of ``logits``.

    Args:
        logits: (n, vocab) untempered logits ``z`` (any float dtype; computed in fp32).
        labels: (n,) int64 token ids.
        temperature: a number, or an (n,) tensor (one per position).
        min_p: kappa in [0, 1]: the support is ``z >= max z + ln kappa`` (kappa 0: every token).
        chunk_rows: positions per chunk.

    Returns:
        (n,) fp32 on ``logits``' device: ``z_y / T - logsumexp_{support}(z / T)``, ``-inf`` where ``y`` is outside
        the support.
    """
    n = logits.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    log_kappa = math.log(min_p) if min_p > 0 else -math.inf
    labels = labels.reshape(-1).to(device=logits.device, dtype=torch.int64)
    per_row_t = isinstance(temperature, torch.Tensor) and temperature.numel() > 1
    if isinstance(temperature, torch.Tensor) and not per_row_t:
        temperature = float(temperature.reshape(-1)[0])
    if per_row_t:
        temperature = temperature.reshape(-1).to(device=logits.device, dtype=torch.float32)
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        z = logits[start:stop].detach().float()
        support = z >= z.amax(dim=-1, keepdim=True) + log_kappa
        scaled = z / (temperature[start:stop].clamp(min=1e-8).unsqueeze(-1) if per_row_t else max(temperature, 1e-8))
        normaliser = torch.logsumexp(scaled.masked_fill(~support, -math.inf), dim=-1)
        picked = labels[start:stop].unsqueeze(-1)
        value = scaled.gather(-1, picked).squeeze(-1) - normaliser
        out[start:stop] = torch.where(support.gather(-1, picked).squeeze(-1), value, value.new_full((), -math.inf))
    return out


def _non_tensor(data, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def _gather_packed(engine, values: torch.Tensor, output_args: dict) -> torch.Tensor:
    """A packed (remove-padding) per-position tensor gathered over the Ulysses SP group and unpadded, as verl does
    for ``log_probs`` (0.9.1: ``_gather_and_unpad_packed``; 0.8.0: ``gather_outputs_and_unpad`` under SP only)."""
    gather = getattr(engine, "_gather_and_unpad_packed", None)
    if gather is not None:
        return gather(values, output_args.get("pad_size", 0))
    if getattr(engine, "use_ulysses_sp", False):
        from verl.utils.ulysses import gather_outputs_and_unpad

        return gather_outputs_and_unpad(values, gather_dim=0, unpad_dim=0, padding_size=output_args["pad_size"])
    return values


def _proxy_of_micro_batch(engine, output, output_args: dict, micro_batch, min_p: float) -> torch.Tensor:
    """The micro-batch's proxy log-probs, nested (batch, j) over each whole sequence like verl's ``log_probs``."""
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    if _non_tensor(micro_batch, "use_fused_kernels", False):
        raise ProxyUnsupportedError(
            "this loss mode computes its proxy pi_proxy from the old policy's logits in verl's log-prob pass, "
            "and use_fused_kernels=True does not materialise them (as verl refuses calculate_sum_pi_squared there): "
            "set actor_rollout_ref.model.use_fused_kernels=False")
    pad_mode = _non_tensor(micro_batch, "pad_mode", DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ProxyUnsupportedError(f"the loss mode's proxy: pad_mode {pad_mode} is not covered (verl's engine "
                                    "supports NO_PADDING only)")
    logits = output.logits
    if hasattr(logits, "full_tensor"):  # a DTensor sharded on the vocabulary (TP): verl gathers it too
        logits = logits.full_tensor()
    cu_seqlens = micro_batch["input_ids"].offsets()
    labels = output_args["input_ids_rmpad_rolled"]
    if _non_tensor(micro_batch, "use_remove_padding", True):
        values = proxy_log_probs_from_logits(logits.squeeze(0), labels, output_args["temperature_rmpad"], min_p)
        values = _gather_packed(engine, values, output_args)
    else:  # padded (bsz, seqlen, vocab): each row's first seq_len positions, row by row (no packed copy)
        temperature = output_args["temperature"].reshape(-1)
        lengths = cu_seqlens.diff().tolist()
        values = torch.empty(int(cu_seqlens[-1]), dtype=torch.float32, device=logits.device)
        for row, length in enumerate(lengths):
            begin = int(cu_seqlens[row])
            values[begin:begin + length] = proxy_log_probs_from_logits(
                logits[row, :length], labels[begin:begin + length], temperature[row], min_p)
    return torch.nested.nested_tensor_from_jagged(values, cu_seqlens.to(values.device))


def prepare_model_outputs_with_proxy(original, engine, output, output_args, micro_batch,
                                     logits_processor_func) -> dict:
    """PATCH ``proxy_log_prob_in_pass``: verl's ``prepare_model_outputs``, plus :data:`PROXY_OUTPUT_KEY` where the
    micro-batch asks for it (:data:`PROXY_REQUEST_KEY`). The proxy is computed first, from the logits as the model
    returned them: verl's own code may then scale them in place."""
    min_p: Optional[float] = _non_tensor(micro_batch, PROXY_REQUEST_KEY, None)
    proxy = None if min_p is None else _proxy_of_micro_batch(engine, output, output_args, micro_batch, float(min_p))
    model_output = original(engine, output, output_args, micro_batch, logits_processor_func)
    if proxy is not None:
        model_output[PROXY_OUTPUT_KEY] = proxy
    return model_output
