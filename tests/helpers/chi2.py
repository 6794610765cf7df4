"""Chi-square tests for sampled tokens against a policy's exact distributions (the
built-in engine's and vLLM's speculative sampling tests)."""

import math

import torch


def chi2_pvalue(stat: float, df: int) -> float:
    # Survival function of chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2).
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def chi2_groups(groups) -> tuple[float, int]:
    """Sum of Pearson statistics over (observed counts, expected probs) groups; bins with an
    expected count below 5 are pooled into one."""
    stat, df = 0.0, 0
    for obs_V, p_V in groups:
        n = obs_V.sum()
        if n < 50:
            continue
        exp_V = p_V.double() * n
        small = exp_V < 5
        o = torch.cat([obs_V[~small].double(), obs_V[small].double().sum()[None]])
        e = torch.cat([exp_V[~small], exp_V[small].sum()[None]])
        keep = e > 0
        if (o[~keep] > 0).any():
            return math.inf, max(df, 1)  # a sample where the policy has zero mass
        o, e = o[keep], e[keep]
        if e[-1] < 5 and e.numel() > 1:  # pooled bin still tiny: fold it into the largest
            j = int(e[:-1].argmax())
            o[j] += o[-1]
            e[j] += e[-1]
            o, e = o[:-1], e[:-1]
        stat += float(((o - e) ** 2 / e).sum())
        df += e.numel() - 1
    return stat, df
