"""Lp-Reg's proxy from logits (``engine/proxy.py``) against the authors' ``apply_min_p`` transcribed: the min-p filter
on the untempered logits (softmax probability >= kappa * max), the rest set to -1e4, then divided by the temperature
and log-softmaxed (Lp-Reg-dev ``dp_actor.py`` l.76-111 and ~196, at 33b27e2)."""

from __future__ import annotations

import math

import pytest
import torch

from verl_klcov_global.engine.proxy import proxy_log_probs_from_logits


def authors_proxy(logits, labels, temperature, min_p):
    """The authors' code: probabilities of the untempered logits, tokens below min_p * max set to -1e4, / T."""
    probs = torch.softmax(logits.double(), dim=-1)
    invalid = probs < min_p * probs.amax(dim=-1, keepdim=True)
    filtered = logits.double().masked_fill(invalid, -1e4)
    scaled = filtered / temperature
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_probs, ~invalid.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("min_p", [0.02, 0.3])
def test_the_proxy_is_the_authors_min_p_filter_at_any_temperature(temperature, min_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 97, generator=generator) * 3
    labels = torch.randint(0, 97, (300,), generator=generator)
    ours = proxy_log_probs_from_logits(logits, labels, temperature, min_p, chunk_rows=64)
    theirs, inside = authors_proxy(logits, labels, temperature, min_p)
    assert inside.any() and (~inside).any()
    assert torch.isinf(ours[~inside]).all() and (ours[~inside] < 0).all()  # theirs: about -1e4 / T
    assert (theirs[~inside] < -1e3).all()
    torch.testing.assert_close(ours[inside].double(), theirs[inside], rtol=0, atol=2e-6)


def test_chunks_per_row_temperatures_and_no_filter():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 31, generator=generator)
    labels = torch.randint(0, 31, (50,), generator=generator)
    temperature = torch.rand(50, generator=generator) + 0.5
    whole = proxy_log_probs_from_logits(logits, labels, temperature, 0.1, chunk_rows=1000)
    chunked = proxy_log_probs_from_logits(logits, labels, temperature, 0.1, chunk_rows=7)
    assert torch.equal(whole, chunked)
    for row in (0, 17, 49):
        one = proxy_log_probs_from_logits(logits[row:row + 1], labels[row:row + 1], float(temperature[row]), 0.1)
        assert torch.equal(one, whole[row:row + 1])
    # kappa 0: no filter, the proxy is the tempered policy itself
    unfiltered = proxy_log_probs_from_logits(logits, labels, temperature, 0.0)
    expected = torch.log_softmax(logits / temperature.unsqueeze(-1), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(unfiltered, expected, rtol=0, atol=1e-6)
    assert proxy_log_probs_from_logits(logits[:0], labels[:0], 1.0, 0.1).shape == (0,)
    assert not math.isnan(float(unfiltered.sum()))
