"""The order one stage runs its micro-batches in: GPipe and 1F1B, as lists of actions.

    GPipe (every stage):  F0 F1 ... F(M-1)  B0 B1 ... B(M-1)        holds M micro-batches' activations
    1F1B (stage s of S):  w = min(S - 1 - s, M) forwards first, then F(w+i) B(i) pairs, then the
                          last w backwards                          holds at most S - s of them

Each stage receives micro-batch k's input from the stage before (its forward) and the gradient of
its output from the stage after (its backward); sends go out without waiting (see :mod:`.transfer`),
so a stage blocks only in a receive. Both schedules run every micro-batch forward once and backward
once, the forward first, and never deadlock under that rule (:func:`simulate` checks it for any S, M).
The schedule orders the work; it does not change the maths: gradients accumulate over the
micro-batches whatever the order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cephalo_lightning._common.vocabulary import PipelineSchedule


class Pass(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    kind: Pass
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.micro_batch}"


def stage_actions(schedule: PipelineSchedule, stage: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    """Stage ``stage``'s actions for one step of ``num_micro_batches`` micro-batches."""
    m = num_micro_batches
    forwards = [Action(Pass.FORWARD, k) for k in range(m)]
    backwards = [Action(Pass.BACKWARD, k) for k in range(m)]
    if schedule is PipelineSchedule.GPIPE:
        return forwards + backwards
    warmup = min(num_stages - 1 - stage, m)
    actions = forwards[:warmup]
    for i in range(m - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[m - warmup:]


def in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``actions``."""
    held = most = 0
    for action in actions:
        held += 1 if action.kind is Pass.FORWARD else -1
        most = max(most, held)
    return most


def simulate(schedule: PipelineSchedule, num_stages: int, num_micro_batches: int) -> list[tuple[int, Action]]:
    """Runs every stage's actions with blocking receives and non-blocking sends; the global order
    (stage, action) they complete in. Raises if the stages deadlock."""
    plans = [stage_actions(schedule, s, num_stages, num_micro_batches) for s in range(num_stages)]
    at = [0] * num_stages
    done: set[tuple[int, Pass, int]] = set()
    order: list[tuple[int, Action]] = []
    while any(at[s] < len(plans[s]) for s in range(num_stages)):
        moved = False
        for s in range(num_stages):
            if at[s] == len(plans[s]):
                continue
            a = plans[s][at[s]]
            if a.kind is Pass.FORWARD:
                ready = s == 0 or (s - 1, Pass.FORWARD, a.micro_batch) in done
            else:
                ready = ((s, Pass.FORWARD, a.micro_batch) in done
                         and (s == num_stages - 1 or (s + 1, Pass.BACKWARD, a.micro_batch) in done))
            if ready:
                done.add((s, a.kind, a.micro_batch))
                order.append((s, a))
                at[s] += 1
                moved = True
        if not moved:
            waiting = {s: str(plans[s][at[s]]) for s in range(num_stages) if at[s] < len(plans[s])}
            raise RuntimeError(f"{schedule} with {num_stages} stages and {num_micro_batches} micro-batches deadlocks: "
                               f"stages waiting on {waiting}")
    return order
