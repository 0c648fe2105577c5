"""Parameter updates against a penalty-free control's float noise, tensor by tensor (test support).

Two layouts of one update differ only by float re-association; each parameter then differs by the noise of its
update or by one rounding to the next float32, whichever is larger. A comparison of the largest absolute difference
over the whole model puts the verdict on the luck of which element rounded: one rounding of a norm weight near 1
(1.2e-7) is 16 times the whole noise of the weights near 0.04 (7.5e-9), and the control may or may not have drawn
such a rounding. So each tensor is compared with its own floor: the control's largest difference in that tensor,
and at least one float32 spacing at the tensor's largest magnitude.
"""

from __future__ import annotations

import numpy as np
import torch


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def tensor_floor(control_a: torch.Tensor, control_b: torch.Tensor) -> float:
    """One tensor's noise floor: the control's largest difference, at least one float32 spacing at its magnitude."""
    magnitude = float(torch.maximum(control_a.detach().abs(), control_b.detach().abs()).max()) if control_a.numel() else 0
    return max(_max_diff(control_a, control_b), float(np.spacing(np.float32(magnitude))))


def ratio_to_control(a: dict, b: dict, control_a: dict, control_b: dict) -> float:
    """max over tensors of |a - b|'s largest element over that tensor's floor (:func:`tensor_floor`) of the control
    pair; state dicts of one model (same keys)."""
    assert set(a) == set(b) == set(control_a) == set(control_b)
    return max(_max_diff(a[k], b[k]) / tensor_floor(control_a[k], control_b[k]) for k in a)


def any_difference(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)
