"""The 80/20 paper's token-entropy figures on a real pretrained LM's own responses (SmolLM2-135M-Instruct, CPU).

"Beyond the 80/20 Rule" (arXiv:2506.01939, Figure 2; Qwen3-8B chain-of-thought) reports that about half of the
tokens have entropy below 0.01 nats and that only 20% exceed 0.672. This command samples responses from SmolLM2
(fp32 weights dequantized from the GGUF's 4 bits; lab/real_model.py) on the built-in arithmetic prompts with the chat
template, at a temperature (1 by default) with no top-k or top-p, stopped at EOS (lab/sampling.py), and reports
over every response token: the share below 0.01, the share above 0.672, the 50th and 80th percentiles, the mean,
and the token count, beside the paper's figures. Each token's entropy is that of the full distribution it was
drawn from.

    .venv/bin/python -m experiments.token_entropy --json docs/real_model_entropy.json

Set-up: ``bash scripts/setup.sh --real-model`` (docs/EVIDENCE.md).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from .study_cli import new_parser, save_json

#: the paper's reading of its Figure 2 (Qwen3-8B, chain-of-thought responses)
PAPER = {"model": "Qwen3-8B (arXiv:2506.01939, Figure 2)", "share_below_0.01": 0.5, "share_above_0.672": 0.2,
         "p80": 0.672}
LOW, HIGH = 0.01, 0.672


def entropy_figures(entropies: torch.Tensor) -> dict:
    """The shares and percentiles of a 1-D tensor of token entropies (nats)."""
    values = entropies.double().sort().values
    count = values.numel()

    def percentile(q: float) -> float:  # the lower nearest rank (no interpolation)
        return float(values[min(count - 1, int(q * count))])

    return {"tokens": count, "share_below_0.01": float((values < LOW).double().mean()),
            "share_above_0.672": float((values > HIGH).double().mean()), "p50": percentile(0.5),
            "p80": percentile(0.8), "mean": float(values.mean())}


def main(argv=None) -> int:
    parser = new_parser("python -m experiments.token_entropy", __doc__)
    parser.add_argument("--prompts", type=int, default=32, help="arithmetic prompts (default 32)")
    parser.add_argument("--samples-per-prompt", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--rows-per-batch", type=int, default=32, help="rows sampled together (default 32)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    from verl_klcov_global.lab import real_model, sampling

    try:
        folder = real_model.prepare(progress=lambda message: print(message, file=sys.stderr, flush=True))
    except real_model.RealModelError as error:
        print(f"token_entropy: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    model, tokenizer = sampling.load_policy(folder)
    prompts = sampling.arithmetic_prompts(args.prompts, seed=args.seed)
    per_batch = max(1, args.rows_per_batch // args.samples_per_prompt)
    entropies, lengths, stopped, rewards = [], [], 0, []
    for start in range(0, len(prompts), per_batch):
        chunk = prompts[start:start + per_batch]
        batch = sampling.sample_chat_responses(model, tokenizer, chunk, samples_per_prompt=args.samples_per_prompt,
                                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                               seed=args.seed + start)
        mask = batch.response_mask.bool()
        entropies.append(batch.entropies[mask])
        lengths += batch.response_mask.sum(1).tolist()
        stopped += int((batch.responses == batch.eos_token_id).any(1).sum())
        rewards += [sampling.answer_reward(text, answer) for text, answer in zip(batch.texts, batch.answers)]
        print(f"[{min(start + per_batch, len(prompts))}/{len(prompts)} prompts] {sum(lengths)} tokens, "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    figures = entropy_figures(torch.cat(entropies))
    report = {
        "model": real_model.SMOLLM2.description,
        "settings": {"prompts": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                     "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
                     "prompt_set": "arithmetic (lab/sampling.py), chat template", "sampling": "full distribution"},
        "responses": len(lengths), "stopped_at_eos": stopped, "mean_response_tokens": sum(lengths) / len(lengths),
        "answer_reward_mean": sum(rewards) / len(rewards),
        "smollm2": figures, "paper": PAPER, "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__, "device": "cpu, fp32",
    }
    print(format_report(report))
    if args.json:
        save_json(report, args.json)  # whole at every moment, its folder made
        print(f"wrote {os.path.abspath(args.json)}", file=sys.stderr)
    return 0


def format_report(report: dict) -> str:
    ours, paper = report["smollm2"], report["paper"]
    settings = report["settings"]
    rows = [("", "SmolLM2-135M-Instruct (here)", paper["model"]),
            ("tokens", f"{ours['tokens']:,}", "-"),
            ("share with entropy < 0.01", f"{ours['share_below_0.01']:.1%}", f"~{paper['share_below_0.01']:.0%}"),
            ("share with entropy > 0.672", f"{ours['share_above_0.672']:.1%}", f"{paper['share_above_0.672']:.0%}"),
            ("80th percentile (nats)", f"{ours['p80']:.3f}", f"{paper['p80']}"),
            ("median (nats)", f"{ours['p50']:.3f}", "-"),
            ("mean (nats)", f"{ours['mean']:.3f}", "-")]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{settings['prompts']} prompts x {settings['samples_per_prompt']} responses, T={settings['temperature']:g}, "
             f"<= {settings['max_new_tokens']} new tokens ({report['stopped_at_eos']} of {report['responses']} "
             f"stopped at EOS; mean {report['mean_response_tokens']:.1f} tokens; answer correct "
             f"{report['answer_reward_mean']:.1%}); {report['seconds']} s on the CPU", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, width)).rstrip() for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
