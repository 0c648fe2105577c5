"""The only place that patches verl (the lab's CPU platform for diagnose and tests aside): one module per concern.

* :mod:`.patches` -- the catalogue of every verl patch (:data:`~.patches.PATCHES`) and their install;
* :mod:`.step` -- the wrapped ``train_batch``: prepass, mask per token, verl's step, the loss wrapper, metrics;
* :mod:`.prepass` -- the no-grad forward (micro-batching, optimizer offload, RNG) and the mode's selection;
* :mod:`.logprobs` -- the prepass's batched log-sum-exp numerics (PATCH ``prepass_batched_logsumexp``);
* :mod:`.weights` -- an engine's weights version, bumped by every write of its parameters the plugin sees
  (PATCH ``weight_restore_bumps_version``);
* :mod:`.kept_pass` -- what is kept of verl's own log-prob pass and the index of its rows (PATCHES
  ``log_prob_pass_context``, ``log_prob_pass_keep``);
* :mod:`.reuse` -- the look-ups in it: verl's pass in place of a prepass where it was made with the same parameters,
  pi_old's held statistics; the agreements over the ranks;
* :mod:`.old_policy` -- ``prepass_layout=old``: pi_old's statistics of a minibatch, no forward;
* :mod:`.control` -- the entropy controller's step per optimizer step, its state per engine;
* :mod:`.batch_entropy`, :mod:`.schedule` -- a mode's once-per-trainer-step rule (STARE's gate) on the batch's
  old-policy entropy from verl's log-prob pass;
* :mod:`.proxy` -- Lp-Reg's proxy, computed in verl's log-prob pass (PATCH ``proxy_log_prob_in_pass``).

Import order (top to bottom): patches -> step -> prepass -> logprobs, reuse -> kept_pass -> weights, old_policy, control, batch_entropy,
schedule, proxy; each may import the package's lower layers (modes, loss, layout, config, seams), never the
plugin, the lab or the CLI.
"""
