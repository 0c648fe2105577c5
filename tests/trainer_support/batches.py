"""Trainer-side batches: what verl's trainers hand to ``_update_actor`` (test-only).

* legacy trainer (``trainer.use_v1=False``): a padded ``DataProto`` (prompts left-padded,
  responses right-padded), as ``RayPPOTrainer.fit`` holds it before ``_update_actor``;
* v1 trainer: the per-sample (nested) ``TensorDict`` a worker reads back from TransferQueue.

Both come from the same tokens, lengths, advantages and old log-probs
(``verl_klcov_global.lab.tiny``'s sample builders).
"""

from __future__ import annotations

import numpy as np

from verl_klcov_global.lab import tiny as _tiny


def _sample(batch_size: int, prompt_len: int, response_len: int, seed: int, group_size: int):
    t = _tiny._padded_sample(
        batch_size=batch_size, prompt_len=prompt_len, response_len=response_len, vary_lengths=True, seed=seed,
        vocab_size=_tiny.TINY_MODEL_KWARGS["vocab_size"], pad_token_id=0, group_size=group_size,
        advantage_noise=0.1,
    )
    t.update(_tiny._log_prob_fields(t, seed=seed, log_probs=None, noise=0.05, with_rollout_is_weights=False,
                                    with_ref_log_prob=False))
    uid = np.array([f"seed{seed}-group{i // group_size}" for i in range(batch_size)], dtype=object)
    return t, uid


def legacy_batch(*, batch_size: int, prompt_len: int, response_len: int, seed: int = 0, group_size: int = 4):
    """``DataProto`` in the legacy trainer's padded layout, with advantages and old log-probs."""
    from verl import DataProto

    t, uid = _sample(batch_size, prompt_len, response_len, seed, group_size)
    return DataProto.from_dict(tensors=t, non_tensors={"uid": uid})


def v1_batch(*, batch_size: int, prompt_len: int, response_len: int, seed: int = 0, group_size: int = 4):
    """``TensorDict`` in the v1 trainer's layout (every per-sample field nested), no trainer keys yet."""
    t, uid = _sample(batch_size, prompt_len, response_len, seed, group_size)
    td = _tiny._v1_td(t, uid, temperature=1.0)
    del td["temperature"]  # the v1 trainer's _update_actor sets it (extra_info)
    return td
