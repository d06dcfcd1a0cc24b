"""A reward function for the fault tests: every reward is NaN, so every update's loss is NaN."""


def always_nan(prompts, completions, **_):
    return [float("nan")] * len(completions)
