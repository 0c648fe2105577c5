"""Selection cost alone: ``select_kl_cov_tokens`` vs verl 0.9.1's ``kl_cov`` selection code, same tensors.

Inputs: float32 advantages / log-probs of shape (rows, 1024) holding exactly ``N``
valid tokens (response lengths uniform in [512, 1024], right padding, the last row
cut to hit ``N``), GRPO-like advantages (one value per sequence + 0.1 N(0, 1) per
token), log-probs in (-8, 0]. Both implementations get the same tensors and are
timed interleaved (one call of each per round, the order alternating), medians over
the rounds, each call synchronised on the device when it is not the CPU.

Baseline: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_kl_cov``
lines 1897-1910 verbatim (the valid-token compaction, the ``.cpu()`` copies, the
means, the covariance, ``topk`` and the mapping back to flat indices). Its line
1911 (writing the penalised losses at those indices) is loss computation, not
selection, and is left out; ``select_kl_cov_tokens`` returns a full mask instead.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any, Callable, Optional

import torch

SIZES = (10**4, 10**5, 10**6)
RATIOS = (0.0002, 0.002)
WIDTH = 1024


def verl_kl_cov_selection(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor,
                          kl_cov_ratio: float) -> torch.Tensor:
    """verl 0.9.1 core_algos.py compute_policy_loss_kl_cov, lines 1897-1910, verbatim; returns flat indices."""
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()

    k = min(kl_cov_ratio, len(all_valid_adv))

    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices

        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
    return large_cov_idxs


def make_tensors(num_valid: int, seed: int = 0, device: str = "cpu"):
    """(advantages, log_probs, response_mask): (rows, 1024) float32/float32/bool with exactly ``num_valid`` valid."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < num_valid:
        lengths.append(int(torch.randint(WIDTH // 2, WIDTH + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - num_valid
    rows = len(lengths)
    mask = torch.arange(WIDTH).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    advantages = (torch.randn(rows, 1, generator=gen) + 0.1 * torch.randn(rows, WIDTH, generator=gen)) * mask
    log_probs = -8 * torch.rand(rows, WIDTH, generator=gen) * mask
    assert int(mask.sum()) == num_valid
    return advantages.to(device), log_probs.to(device), mask.to(device)


def load_selection(path: Optional[str]) -> Callable:
    """``select_kl_cov_tokens`` of the installed package, or of a selection.py at ``path`` (a candidate patch)."""
    if not path:
        from verl_klcov_global.methods.kl_cov.selection import select_kl_cov_tokens

        return select_kl_cov_tokens
    spec = importlib.util.spec_from_file_location("_candidate_selection", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.select_kl_cov_tokens


def _timed(fn: Callable, device: str) -> tuple[float, float, Any]:
    """(wall seconds, process CPU seconds, result) of one call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, time.process_time() - c0, out


def compare(num_valid: int, ratio: float, *, rounds: int, device: str, select: Callable) -> dict[str, Any]:
    from ._common import median

    a, lp, m = make_tensors(num_valid, device=device)
    ours_fn = lambda: select(a, lp, m, ratio)  # noqa: E731
    verl_fn = lambda: verl_kl_cov_selection(a, lp, m, ratio)  # noqa: E731
    _timed(ours_fn, device), _timed(verl_fn, device)  # warm-up
    ours, base, ours_cpu, base_cpu = [], [], [], []
    for r in range(rounds):
        pair = [(ours, ours_cpu, ours_fn), (base, base_cpu, verl_fn)]
        for samples, cpu_samples, fn in pair if r % 2 == 0 else pair[::-1]:
            seconds, cpu_seconds, _ = _timed(fn, device)
            samples.append(seconds)
            cpu_samples.append(cpu_seconds)
    result = ours_fn()
    chosen = set(result.mask.reshape(-1).nonzero().flatten().tolist())
    upstream = set(verl_fn().tolist())
    return {
        "device": device, "num_valid": num_valid, "shape": list(a.shape), "ratio": ratio, "quota": result.quota,
        "rounds": rounds, "threads": torch.get_num_threads(),
        "ours_ms": median(ours) * 1e3, "verl_ms": median(base) * 1e3,
        "speedup_verl_over_ours": median(base) / median(ours),
        "ours_min_ms": min(ours) * 1e3, "verl_min_ms": min(base) * 1e3,
        # process CPU time (all threads); with 1 thread it hardly depends on other load on the machine
        "ours_cpu_ms": median(ours_cpu) * 1e3, "verl_cpu_ms": median(base_cpu) * 1e3,
        "ours_samples_ms": [x * 1e3 for x in ours], "verl_samples_ms": [x * 1e3 for x in base],
        "same_tokens": chosen == upstream, "tokens_only_ours": len(chosen - upstream),
        "tokens_only_verl": len(upstream - chosen),
    }


def run(*, quick: bool, sizes=SIZES, ratios=RATIOS, rounds: Optional[int] = None, threads=None,
        selection_impl: Optional[str] = None, progress=print) -> dict[str, Any]:
    """Every (device, thread count, size, ratio); threads: list of CPU thread counts (None: the current one)."""
    rounds = rounds if rounds is not None else (3 if quick else 15)
    select = load_selection(selection_impl)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    default_threads = torch.get_num_threads()
    results = []
    try:
        for device in devices:
            for n_threads in (threads or [default_threads]) if device == "cpu" else [default_threads]:
                torch.set_num_threads(n_threads)
                for size in sizes:
                    for ratio in ratios:
                        row = compare(size, ratio, rounds=rounds, device=device, select=select)
                        progress(f"[selection] {device} threads={n_threads} N={size:.0e} ratio={ratio}: "
                                 f"ours {row['ours_ms']:.2f} ms, verl {row['verl_ms']:.2f} ms, "
                                 f"same tokens {row['same_tokens']}")
                        results.append(row)
    finally:
        torch.set_num_threads(default_threads)
    return {"selection_impl": selection_impl or "verl_klcov_global.selection (installed)", "rows": results}


def report(result: dict[str, Any]) -> str:
    from ._common import table

    rows = [[r["device"], r["threads"], r["num_valid"], r["ratio"], r["quota"], r["ours_ms"], r["verl_ms"],
             f"{r['speedup_verl_over_ours']:.2f}x", r["ours_cpu_ms"], r["verl_cpu_ms"],
             f"{r['verl_cpu_ms'] / r['ours_cpu_ms']:.2f}x", "yes" if r["same_tokens"] else
             f"no (+{r['tokens_only_ours']}/-{r['tokens_only_verl']})"] for r in result["rows"]]
    return table(["device", "threads", "valid tokens", "ratio", "k", "ours ms", "verl ms", "verl/ours",
                  "ours cpu ms", "verl cpu ms", "verl/ours cpu", "same tokens"], rows)


__all__ = ["verl_kl_cov_selection", "make_tensors", "load_selection", "run", "report"]
