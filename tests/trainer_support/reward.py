"""Rule reward for the end-to-end run (``reward.custom_reward_function.path``), test-only.

Random-token responses never solve anything, so a task reward would be 0 for every response and
GRPO's advantages would all be 0. This score depends only on the response text, so responses of one
prompt get different scores and the advantages (and the KL-Cov covariances) are not degenerate.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return (len(solution_str) % 7) / 6.0
