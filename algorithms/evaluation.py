"""Evaluation math: the unbiased pass@k estimator."""
from __future__ import annotations

import torch


def pass_at_k(correct: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Chance that at least one of k samples drawn without replacement from n is correct, given `correct` (P,) of
    them were, per prompt: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained
    on Code", eq. 1), computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the large
    binomials. Returns (P,) float64; mean it over prompts for the benchmark figure."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = correct.to(torch.float64)
    if ((c < 0) | (c > n)).any():
        raise ValueError(f"correct counts must lie in [0, n={n}]")
    i = torch.arange(1, n + 1, dtype=torch.float64)  # (n,)
    # Factor i contributes (1 - k/i) when i > n - c; the product over those is C(n-c, k) / C(n, k).
    factors = torch.where(i[None, :] > (n - c)[:, None], 1.0 - k / i[None, :], torch.ones(()))
    out = 1.0 - factors.prod(dim=1)
    return torch.where(n - c < k, torch.ones_like(out), out)


def pass_at_k_levels(n: int) -> list[int]:
    """The k reported for n samples: 1, powers of two below n, and n."""
    return sorted({1, n, *(2 ** j for j in range(1, n.bit_length()) if 2 ** j < n)})
