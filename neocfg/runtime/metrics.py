"""Held-out quality metrics: log loss, normalized entropy (He et al., ADKDD'14) and ROC AUC."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Clamp probabilities away from 0 and 1 so the log loss stays finite.
PROB_EPS = 1e-7


@dataclass(frozen=True)
class EvalMetrics:
    samples: int
    logloss: float
    ne: float
    auc: float
    ctr: float


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum (Mann-Whitney) statistic, ties at their average rank."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    pos = float(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    s = scores[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    uniq, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    if uniq.numel() < s.numel():
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, torch.arange(
            1, s.numel() + 1, dtype=torch.float64))
        ranks[order] = (sums / counts)[inverse]
    rank_sum = float(ranks[labels == 1].sum())
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def evaluate(logits: torch.Tensor, labels: torch.Tensor) -> EvalMetrics:
    p = torch.sigmoid(logits.double()).clamp(PROB_EPS, 1 - PROB_EPS)
    y = labels.double()
    logloss = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
    ctr = float(y.mean())
    base = -(ctr * math.log(max(ctr, PROB_EPS)) + (1 - ctr) * math.log(max(1 - ctr, PROB_EPS)))
    return EvalMetrics(samples=int(y.numel()), logloss=logloss, ne=logloss / base if base > 0 else float("nan"),
                       auc=auc(logits, labels), ctr=ctr)
