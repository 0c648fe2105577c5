"""What the GPU kit's phases share: sizes, the phase record with its budget, progress lines.

:mod:`.gpu_check` (the runner) and the phase modules :mod:`.gpu_branches` and :mod:`.gpu_step`
import from here and never from each other's runner, so the kit's imports read top to bottom
(gpu_check -> gpu_branches / gpu_step -> gpu_phases).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Optional

#: Qwen2.5-0.5B's shape (its config.json), random weights: the step phase's model on a GPU.
QWEN25_05B_LIKE = dict(
    vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0,
    rms_norm_eps=1e-6, attention_dropout=0.0, use_sliding_window=False,
)


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke; the code path is the same."""

    budget_seconds: float
    phase_budgets: dict
    diagnose_blocks: int
    diagnose_batch: int
    diagnose_prompt: int
    diagnose_response: int
    diagnose_micro_batches: int
    step_model: str  # "qwen2.5-0.5b-like" or "tiny"
    step_batch: int
    step_prompt: int
    step_response_min: int
    step_response_max: int
    step_max_token_len: int  # ppo_max_token_len_per_gpu (training micro-batches)
    step_infer_max_token_len: int  # log_prob_max_token_len_per_gpu (compute_log_prob and the prepass)
    step_reps: int
    kl_cov_ratio: float


GPU = Sizes(
    budget_seconds=400,
    phase_budgets={"env": 30, "branches": 60, "diagnose": 150, "step": 220},
    diagnose_blocks=3, diagnose_batch=64, diagnose_prompt=16, diagnose_response=128, diagnose_micro_batches=8,
    # examples/dapo_kl_cov_global.sh: one token budget for training and log-probs; ratio 0.002 [paper, 7B]
    step_model="qwen2.5-0.5b-like", step_batch=16, step_prompt=512, step_response_min=2048, step_response_max=4096,
    step_max_token_len=16384, step_infer_max_token_len=16384, step_reps=2, kl_cov_ratio=0.002,
)
# The smoke takes ~50 s on 2 shared cores; its budgets are ceilings with room for a busy CI machine.
SMOKE = Sizes(
    budget_seconds=270,
    phase_budgets={"env": 45, "branches": 60, "diagnose": 150, "step": 100},
    diagnose_blocks=1, diagnose_batch=16, diagnose_prompt=8, diagnose_response=32, diagnose_micro_batches=4,
    step_model="tiny", step_batch=8, step_prompt=16, step_response_min=32, step_response_max=64,
    step_max_token_len=160, step_infer_max_token_len=320, step_reps=1, kl_cov_ratio=0.02,
)


class Stopped(BaseException):
    """SIGTERM arrived (the shell's overall timeout). A BaseException, so no ``except Exception`` on the
    way (verl, torch, this kit) swallows it."""


class PhaseBudgetExceeded(Exception):
    """A phase ran out of its time budget before a part that needs more."""


@dataclass
class Check:
    phase: str
    name: str
    ok: Optional[bool]  # None: not applicable on this device (``detail`` says why)
    detail: str


@dataclass
class Phase:
    """What one phase gets: its device, sizes, scratch folder, deadline; what it records."""

    name: str
    device: str
    sizes: Sizes
    scratch: str
    deadline: float
    checks: list[Check] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, name: str, ok: Optional[bool], detail: str) -> None:
        self.checks.append(Check(self.name, name, ok, detail))
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[ok]
        progress(f"  [{mark}] {name}: {detail}")

    def note(self, message: str) -> None:
        self.notes.append(message)
        progress(f"  note: {message}")

    def need(self, seconds: float, what: str) -> None:
        """Raise :class:`PhaseBudgetExceeded` unless ``seconds`` remain for ``what``."""
        if self.remaining() < seconds:
            raise PhaseBudgetExceeded(f"{what}: needs ~{seconds:.0f} s, {max(0.0, self.remaining()):.0f} s left")


def progress(message: str) -> None:
    # the real stdout: diagnose.quiet_verl() swaps sys.stdout while engines work
    print(message, file=sys.__stdout__, flush=True)
