"""Rule reward of the recipe miniatures (``reward.custom_reward_function.path``), test-only.

The ``dapo`` reward manager calls it and keeps its ``acc`` for dynamic sampling (``filter_groups.metric=acc``).
The even-indexed prompts score 0 whatever the response: their groups are all equal, so DAPO's dynamic sampling
drops them and refills the batch, every step. The odd-indexed ones score from the response text (random tokens
never solve the sum), so their responses differ and the advantages are not degenerate.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    index = (int(ground_truth) - 1) // 2  # experiments.local_trainer.write_dataset: "What is i + i+1?" -> 2i+1
    score = 0.0 if index % 2 == 0 else (len(solution_str) % 7) / 6.0
    return {"score": score, "acc": score}
