"""The one error the planner raises for input it cannot plan."""

from cephalo_lightning._common.errors import CephaloError


class PlanningError(CephaloError, ValueError):
    """A cluster, model or batch the planner cannot turn into a feasible plan.

    The message always says what is wrong or short, by how much, and what to change.
    """


REMAKE = "re-make the plan with `python -m cephalo_lightning plan`"  # the fix for a plan file that is wrong
