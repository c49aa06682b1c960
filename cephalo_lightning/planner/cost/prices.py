"""The per-layer price of the collectives (ms): one all-gather ``ag`` and one reduce-scatter ``rs``.

Every time the planner prices, a layer's passes pay ``ag`` per gather and ``rs`` per reduction
(:meth:`.device_cost.DeviceCost.collectives`), so the two travel together: from the link prices,
through the option tables, the feasibility check at a step time, the searches and the assignment
built from their choice. One group's prices are floats; every rank's, under a grouping, arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Prices:
    """One layer's all-gather and reduce-scatter (the cross-group reduction included), in ms."""

    ag: float | np.ndarray
    rs: float | np.ndarray

    def at(self, ranks: Any) -> Prices:
        """The prices of some ranks (an index or an index array) out of every rank's."""
        ag, rs = np.asarray(self.ag)[ranks], np.asarray(self.rs)[ranks]
        return Prices(float(ag), float(rs)) if np.ndim(ag) == 0 else Prices(ag, rs)

    def scaled(self, factor: float) -> Prices:
        """Both prices times ``factor`` (an uneven shard's surcharge)."""
        return Prices(self.ag * factor, self.rs * factor)


FREE = Prices(0.0, 0.0)  # collectives that cost nothing: bounds from compute alone
