"""The harness that ``verl-klcov-global diagnose``, the tests, the experiments and the benchmarks stand on: not
needed to train with the plugin.

* :mod:`.cpu` -- runs verl's real FSDP engine on a CPU (platform shim, engine registry, gloo, spawn);
* :mod:`.tiny` -- a tiny Qwen2 and tokenizer built locally, trainer-shaped minibatches, actor configs;
* :mod:`.experiment` -- the experiment of verl issue #7829: does an update depend on micro-batching?
* :mod:`.per_micro_batch` -- the authors' per-micro-batch rules, the comparators of ``high_entropy_global``,
  ``stare_global`` and ``lp_reg_global``;
* :mod:`.real_model` -- SmolLM2-135M-Instruct from its pip wheel, converted once to a local HF folder;
* :mod:`.sampling` -- responses sampled from a real HF causal LM, as a rollout would make them;
* :mod:`.quiet` -- verl's chatter hidden while an engine works.

The command is :mod:`verl_klcov_global.diagnose`, which imports from here, never the other way. The research
harness built on it (verl's trainer loop in-process, whole runs, learning runs and their pictures) lives outside
the installed package, in the repository's ``experiments/``.
"""
