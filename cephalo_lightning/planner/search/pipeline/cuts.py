"""Contiguous layer cuts that minimise the slowest stage (dynamic programming).

Stage s computing l layers takes ``T[s][l]`` (infinite where it does not fit); the cut
``l_0 + ... + l_{S-1} = L``, every ``l_s >= 1``, minimising ``max_s T[s][l_s]`` is::

    best[0][j] = T[0][j]
    best[s][j] = min_{1 <= l <= j - s} max(best[s - 1][j - l], T[s][l])

O(S L^2), exact: every cut is a sequence of layer counts and the recursion weighs each once.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def best_cuts(num_layers: int, num_stages: int, stage_time: Callable[[int, int], float]
              ) -> tuple[tuple[int, ...], float] | None:
    """The layer counts per stage minimising the slowest stage, and its time; None if no cut fits.

    ``stage_time(s, l)``: stage s's time with l layers (``math.inf`` where it does not fit)."""
    L, S = num_layers, num_stages
    if S < 1 or L < S:
        return None
    top = L - S + 1  # the most layers one stage can take
    table = [[math.inf] + [stage_time(s, l) for l in range(1, top + 1)] for s in range(S)]
    best = [[math.inf] * (L + 1) for _ in range(S)]
    choice = [[0] * (L + 1) for _ in range(S)]
    for j in range(1, top + 1):
        best[0][j], choice[0][j] = table[0][j], j
    for s in range(1, S):
        for j in range(s + 1, L - (S - 1 - s) + 1):
            for l in range(1, min(top, j - s) + 1):
                value = max(best[s - 1][j - l], table[s][l])
                if value < best[s][j]:
                    best[s][j], choice[s][j] = value, l
    if math.isinf(best[S - 1][L]):
        return None
    cuts, j = [], L
    for s in range(S - 1, -1, -1):
        cuts.append(choice[s][j])
        j -= choice[s][j]
    return tuple(reversed(cuts)), best[S - 1][L]
