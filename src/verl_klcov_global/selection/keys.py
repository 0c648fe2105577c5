"""Sampling keys that are a pure function of (seed, optimizer step, a sequence's token ids, a token's position).

Sampling ``k`` of ``n`` candidates uniformly without replacement = keeping the ``k`` largest of
``n`` independent uniform keys. Here the keys are 64-bit hashes, so the draw is a pure function
of the tokens themselves and of the optimizer step it is made for: the same minibatch at the same
optimizer step gives the same keys whatever the micro-batching, the sample order or the
data-parallel split; another sequence, or the same one at another optimizer step (a later PPO
epoch), gets an independent draw. No RNG state is read or advanced.

The mixing function is splitmix64's (Steele, Lea, Flood 2014; ``x + 0x9E3779B97F4A7C15``
then two xor-shift-multiply rounds). torch has no unsigned 64-bit arithmetic on every device,
and signed int64 overflow is undefined behaviour in the C++ kernels, so every 64-bit value is
carried as two 32-bit halves in int64 tensors and every product is formed from 16-bit limbs:
no intermediate ever exceeds 2**35. The results are therefore exact and identical on any
device; :func:`splitmix64_reference` / :func:`token_key_reference` are pure-Python versions of
the same functions (tests compare them bit for bit).

Definitions (all arithmetic modulo 2**64; ``ids`` are the sequence's real tokens in order,
each taken modulo 2**32):

* ``sequence_hash = splitmix64(sum_j splitmix64(j * 2**32 + ids[j]))``
* ``draw = splitmix64(seed)`` at optimizer step 0, ``splitmix64(seed) ^ splitmix64(step ^ STEP_TAG)`` at step
  ``step >= 1`` (:data:`STEP_TAG` keeps the steps' stream apart from the seeds'; step 0 is the seed alone)
* ``row = splitmix64(sequence_hash ^ draw)``
* ``key(t) = splitmix64(row ^ splitmix64(t))`` for the token at response position ``t``,
  returned as the signed int64 with the same 64 bits.

Two exactly identical sequences get identical keys at one step (a tie, broken by minibatch order in
:func:`.collectives.select_largest_keys`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = [
    "MAX_SEED",
    "STEP_TAG",
    "draw_state",
    "sequence_hashes",
    "token_keys",
    "splitmix64_reference",
    "token_key_reference",
]

_M16 = 0xFFFF
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
#: Seeds and optimizer steps are integers in [0, MAX_SEED): exact in float64, so ranks can agree on them
#: (agree_and_mean).
MAX_SEED = 1 << 53
#: Mixed into an optimizer step before it is hashed ("STEPSTEP" in ASCII), so step s and seed s give other draws.
STEP_TAG = 0x5354455053544550

_Pair = tuple[torch.Tensor, torch.Tensor]  # (high 32 bits, low 32 bits), each int64 in [0, 2**32)


def _split(constant: int) -> tuple[int, int]:
    return (constant >> 32) & _M32, constant & _M32


def _mul_lo32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2**32 for a in [0, 2**32) and a constant b in [0, 2**32)."""
    a0, a1 = a & _M16, a >> 16
    b0, b1 = b & _M16, b >> 16
    return (a0 * b0 + (((a1 * b0 + a0 * b1) & _M16) << 16)) & _M32


def _mul_wide32(a: torch.Tensor, b: int) -> _Pair:
    """The full 64-bit product a * b as (high, low) halves; a, b in [0, 2**32)."""
    a0, a1 = a & _M16, a >> 16
    b0, b1 = b & _M16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # each < 2**32
    mid = (p00 >> 16) + (p01 & _M16) + (p10 & _M16)  # < 3 * 2**16
    low = (p00 & _M16) | ((mid & _M16) << 16)
    high = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)  # < 2**32: the product fits in 64 bits
    return high, low


def _mul64(x: _Pair, constant: int) -> _Pair:
    """x * constant mod 2**64."""
    high, low = x
    c_high, c_low = _split(constant)
    product_high, product_low = _mul_wide32(low, c_low)
    product_high = (product_high + _mul_lo32(high, c_low) + _mul_lo32(low, c_high)) & _M32
    return product_high, product_low


def _add64_constant(x: _Pair, constant: int) -> _Pair:
    c_high, c_low = _split(constant)
    low = x[1] + c_low
    return (x[0] + c_high + (low >> 32)) & _M32, low & _M32


def _xor(x: _Pair, y: _Pair) -> _Pair:
    return x[0] ^ y[0], x[1] ^ y[1]


def _xor_shift_right(x: _Pair, shift: int) -> _Pair:
    """x ^ (x >> shift) for 0 < shift < 32."""
    high, low = x
    shifted_low = (low >> shift) | ((high & ((1 << shift) - 1)) << (32 - shift))
    return high ^ (high >> shift), low ^ shifted_low


def _splitmix64(x: _Pair) -> _Pair:
    z = _add64_constant(x, _GAMMA)
    z = _mul64(_xor_shift_right(z, 30), _MUL1)
    z = _mul64(_xor_shift_right(z, 27), _MUL2)
    return _xor_shift_right(z, 31)


def _to_signed(x: _Pair) -> torch.Tensor:
    """The int64 with the same 64 bits; high * 2**32 with a signed high half cannot overflow."""
    high, low = x
    signed_high = high - ((high >> 31) << 32)
    return signed_high * (1 << 32) + low


def sequence_hashes(token_ids: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> _Pair:
    """64-bit hash of each row's real tokens, as (high, low) int64 halves of shape (batch,).

    Args:
        token_ids: (batch, length) integer token ids, taken modulo 2**32 (vocabulary ids are
            far below it; the reduction only keeps the arithmetic defined for any input).
        token_mask: (batch, length) bool, True at the row's real tokens (any padding, left or
            right, is skipped; positions count real tokens only). None: every token is real.
    """
    if token_ids.dim() != 2 or token_ids.is_floating_point() or token_ids.is_complex():
        raise ValueError(f"token_ids must be a 2-D integer tensor (batch, length), got {token_ids.dtype} "
                         f"{tuple(token_ids.shape)}")
    ids = token_ids.to(torch.int64) & _M32
    mask = torch.ones_like(ids, dtype=torch.bool) if token_mask is None else token_mask.to(ids.device).bool()
    if mask.shape != ids.shape:
        raise ValueError(f"token_mask {tuple(mask.shape)} must have the shape of token_ids {tuple(ids.shape)}")
    positions = (torch.cumsum(mask.to(torch.int64), dim=1) - 1).clamp_min_(0)
    tags = _splitmix64((positions, ids))
    # Sums of < 2**31 values below 2**32 fit in int64; the low sum's carry joins the high half.
    zero = ids.new_zeros(())
    sum_low = torch.where(mask, tags[1], zero).sum(dim=1)
    sum_high = torch.where(mask, tags[0], zero).sum(dim=1)
    return _splitmix64(((sum_high + (sum_low >> 32)) & _M32, sum_low & _M32))


def draw_state(seed: int, optimizer_step: int = 0) -> int:
    """The draw's 64-bit state ``draw`` (see the module docstring) for ``seed`` at ``optimizer_step``, both integers
    in [0, :data:`MAX_SEED`)."""
    for name, value in (("seed", seed), ("optimizer_step", optimizer_step)):
        if not (0 <= value < MAX_SEED):
            raise ValueError(f"{name} must be in [0, 2**53), got {value}")
    state = splitmix64_reference(seed)
    return state ^ splitmix64_reference(optimizer_step ^ STEP_TAG) if optimizer_step else state


def token_keys(seed: int, hashes: _Pair, positions: torch.Tensor, optimizer_step: int = 0) -> torch.Tensor:
    """int64 keys ``key(t)`` (see the module docstring), elementwise.

    Args:
        seed: integer in [0, :data:`MAX_SEED`).
        hashes: (high, low) halves of the tokens' sequence hashes (:func:`sequence_hashes`).
        positions: int64 response positions ``t`` >= 0, same shape as the halves.
        optimizer_step: the optimizer step the draw is for, an integer in [0, :data:`MAX_SEED`) (0: the seed's draw).
    """
    high, low = hashes
    seed_high, seed_low = _split(draw_state(seed, optimizer_step))  # the same function on a Python int
    row = _splitmix64((high ^ seed_high, low ^ seed_low))
    position_mix = _splitmix64((torch.zeros_like(positions, dtype=torch.int64), positions.to(torch.int64)))
    return _to_signed(_splitmix64(_xor(row, position_mix)))


# ---------------------------------------------------------------------------------------------
# Pure-Python references (the definitions, for tests)


def splitmix64_reference(x: int) -> int:
    """splitmix64's output for state ``x`` (unsigned 64-bit ints)."""
    z = (x + _GAMMA) & _M64
    z = ((z ^ (z >> 30)) * _MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MUL2) & _M64
    return z ^ (z >> 31)


def token_key_reference(seed: int, ids: Sequence[int], position: int, optimizer_step: int = 0) -> int:
    """The signed int64 key of response position ``position`` of the sequence with real tokens ``ids`` at
    ``optimizer_step``."""
    total = sum(splitmix64_reference((j << 32) + (token & _M32)) for j, token in enumerate(ids)) & _M64
    draw = splitmix64_reference(seed)
    if optimizer_step:
        draw ^= splitmix64_reference(optimizer_step ^ STEP_TAG)
    row = splitmix64_reference(splitmix64_reference(total) ^ draw)
    key = splitmix64_reference(row ^ splitmix64_reference(position))
    return key - (1 << 64) if key >= 1 << 63 else key
