"""The lab behind ``verl-klcov-global diagnose`` and the tests: not needed to train with the plugin.

* :mod:`.cpu` -- runs verl's real FSDP engine on a CPU (platform shim, engine registry, gloo, spawn);
* :mod:`.tiny` -- a tiny Qwen2 and tokenizer built locally, trainer-shaped minibatches, actor configs;
* :mod:`.experiment` -- the experiment of verl issue #7829: does an update depend on micro-batching?
* :mod:`.diagnose` -- that experiment as a report with a verdict (``verl-klcov-global diagnose``);

The research harness built on it (verl's trainer loop in-process, whole runs, learning runs and
their pictures) lives outside the installed package, in the repository's ``experiments/``.
"""
