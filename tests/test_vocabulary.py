"""The closed vocabularies (``cephalo_lightning._common.vocabulary``): each member is the string the
package's files, options and plans carry, so both compare equal and serialise alike."""

from __future__ import annotations

import json

from cephalo_lightning._common.vocabulary import Collective, Grouping, Planner, ProfileSource, Schedule, Verdict, values_of
from cephalo_lightning.lightning.callback.callback_config import MODES
from cephalo_lightning.planner.search.input_checks import PLANNERS
from cephalo_lightning.planner.search.peers import BASELINES


def test_members_are_the_strings_files_and_options_carry():
    assert [s.value for s in Schedule] == ["layered", "uniform"] == list(values_of(Schedule)) == list(MODES[1:])
    assert [c.value for c in Collective] == ["padded", "exact"] == list(values_of(Collective))
    assert [v.value for v in Verdict] == ["feasible", "infeasible", "unknown"]
    assert [s.value for s in ProfileSource] == ["measured", "catalog", "emulated"]
    assert [g.value for g in Grouping] == ["full", "per-node", "node-halves", "node-pairs", "per-rank"]
    assert [p.value for p in Planner][: len(PLANNERS)] == list(PLANNERS)
    assert list(BASELINES) == list(PLANNERS[1:])
    assert {p.value for p in Planner} - set(PLANNERS) == {"elastic", "provisional"}


def test_a_member_equals_its_string_and_prints_as_it():
    for member in (*Schedule, *Collective, *Planner, *Verdict, *ProfileSource, *Grouping):
        assert member == member.value and hash(member) == hash(member.value)
        assert str(member) == f"{member}" == member.value and json.dumps(member) == json.dumps(member.value)
    assert {"even": 1}[Planner.EVEN] == 1
    assert all(type(value) is str for value in (*values_of(Collective), *MODES[1:], *BASELINES, *values_of(Schedule)))
