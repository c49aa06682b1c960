"""The per-layer price of the collectives (ms): one all-gather ``ag`` and one reduce-scatter ``rs``.

Every time the planner prices, a layer's passes pay ``ag`` per gather and ``rs`` per reduction
(:meth:`.cost.DeviceCost.collectives`), so the two travel together: through the option tables,
the feasibility check at a step time, the searches and the assignment built from their choice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    """One layer's all-gather and reduce-scatter (the cross-group reduction included), in ms."""

    ag: float
    rs: float

    def scaled(self, factor: float) -> Prices:
        """Both prices times ``factor`` (an uneven shard's surcharge)."""
        return Prices(self.ag * factor, self.rs * factor)


FREE = Prices(0.0, 0.0)  # collectives that cost nothing: bounds from compute alone
