"""The closed vocabularies (``cephalo_lightning._common.vocabulary``): each member is the string the
package's files, options and plans carry, so both compare equal and serialise alike."""

from __future__ import annotations

import inspect
import json
import typing
from pathlib import Path
from typing import get_args

import pytest

from cephalo_lightning._common.vocabulary import (
    AUTO,
    Collective,
    CollectiveChoice,
    Grouping,
    Handback,
    HandbackChoice,
    Planner,
    ProfileSource,
    Schedule,
    ScheduleChoice,
    Verdict,
    values_of,
)
from cephalo_lightning.lightning.callback.callback_config import MODES as CALLBACK_MODES
from cephalo_lightning.lightning.callback.callback_config import CallbackConfig
from cephalo_lightning.lightning.strategy.cephalo_strategy import CephaloStrategy
from cephalo_lightning.lightning.strategy.fabric import CephaloFabricStrategy
from cephalo_lightning.lightning.strategy_config import COLLECTIVES, HANDBACKS, MODES, StrategyConfig
from cephalo_lightning.planner import (
    Plan,
    PlanningError,
    RankPlan,
    Settings,
    cluster_from_dict,
    cluster_to_dict,
    load_cluster,
    plan,
    save_cluster,
)
from cephalo_lightning.planner.search.input_checks import PLANNERS
from cephalo_lightning.planner.search.peers import BASELINES
from cephalo_lightning.profiling.options import ProfileOptions
from cephalo_lightning.runtime.collectives import resolve_mode


def test_members_are_the_strings_files_and_options_carry():
    assert [s.value for s in Schedule] == ["layered", "uniform"] == list(values_of(Schedule)) == list(CALLBACK_MODES[1:])
    assert [c.value for c in Collective] == ["padded", "exact"] == list(values_of(Collective))
    assert [v.value for v in Verdict] == ["feasible", "infeasible", "unknown"]
    assert [s.value for s in ProfileSource] == ["measured", "catalog", "emulated"]
    assert [g.value for g in Grouping] == ["full", "per-node", "node-halves", "node-pairs", "per-rank"]
    assert [h.value for h in Handback] == ["all", "rank0", "none"]
    assert [p.value for p in Planner][: len(PLANNERS)] == list(PLANNERS)
    assert list(BASELINES) == list(PLANNERS[1:])
    assert {p.value for p in Planner} - set(PLANNERS) == {"elastic", "provisional"}


def test_a_member_equals_its_string_and_prints_as_it():
    for member in (*Schedule, *Collective, *Planner, *Verdict, *ProfileSource, *Grouping, *Handback):
        assert member == member.value and hash(member) == hash(member.value)
        assert str(member) == f"{member}" == member.value and json.dumps(member) == json.dumps(member.value)
    assert {"even": 1}[Planner.EVEN] == 1
    assert all(type(value) is str for value in (*values_of(Collective), *CALLBACK_MODES[1:], *BASELINES, *values_of(Schedule)))


# ----------------------------------------------------------------------------- strings stop at the door

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"
CALIBRATION = {"step_overhead_ms": 1.0, "micro_batch_overhead_ms": 2.0, "allgather_ms": 0.5, "reduce_scatter_ms": 0.5,
               "overlap": 0.5, "source": "emulated", "mode": "uniform"}


def test_a_plan_read_from_json_holds_members_and_writes_plain_strings(tmp_path):
    made = plan(load_cluster(CLUSTERS / "t4-example.yaml"), 48, mode="uniform", planner="cephalo")
    path = tmp_path / "plan.json"
    made.save(path)
    read = Plan.load(path)
    assert type(read.mode) is Schedule and read.mode is Schedule.UNIFORM
    assert type(read.planner) is Planner and read.planner is Planner.CEPHALO
    assert all(type(r.source) is ProfileSource for r in read.ranks)
    data = read.to_dict()  # what a file, a logger or a checkpoint's info holds: the plain strings
    assert type(data["mode"]) is str and type(data["planner"]) is str
    assert all(type(r["source"]) is str for r in data["ranks"])
    assert read == made and Plan.from_dict(json.loads(json.dumps(data))) == read


def test_a_record_given_strings_holds_members():
    even = Plan.even(2, 4, mode="uniform")
    assert type(even.mode) is Schedule and type(even.planner) is Planner
    rank = RankPlan(0, "cpu", 4, 1, 4, 1.0, source="catalog")
    assert type(rank.source) is ProfileSource
    with pytest.raises(PlanningError, match=r"RankPlan.source must be one of \('measured', 'catalog', 'emulated'\), got 'guessed'"):
        RankPlan(0, "cpu", 4, 1, 4, 1.0, source="guessed")
    assert type(Settings(collective="exact").collective) is Collective
    assert type(resolve_mode("exact")) is Collective and type(resolve_mode(AUTO)) is Collective
    assert StrategyConfig.build(mode="layered", collective="padded").mode is Schedule.LAYERED
    assert StrategyConfig.build(collective="exact").collective is Collective.EXACT
    assert StrategyConfig.build().mode == AUTO and StrategyConfig.build().collective == AUTO
    assert CallbackConfig(mode="uniform").mode is Schedule.UNIFORM
    assert ProfileOptions(collective_modes=("exact", "padded")).collective_modes == (Collective.EXACT, Collective.PADDED)


def test_a_bad_vocabulary_string_in_a_plan_file_is_refused_naming_the_choices(tmp_path):
    data = plan(load_cluster(CLUSTERS / "t4-example.yaml"), 48).to_dict()
    for change, message in (
            (lambda d: d.update(planner="fastest"),
             r"'planner' must be one of \('cephalo', 'even', .*'provisional'\), got 'fastest'"),
            (lambda d: d["ranks"][0].update(source="guessed"),
             r"ranks\[0\]\.source \(rank 0\) must be one of \('measured', 'catalog', 'emulated'\), got 'guessed'")):
        bad = json.loads(json.dumps(data))
        change(bad)
        with pytest.raises(PlanningError, match=message):
            Plan.from_dict(bad)


def test_a_cluster_read_from_a_file_holds_members_and_writes_yaml(tmp_path):
    data = cluster_to_dict(load_cluster(CLUSTERS / "t4-example.yaml"))
    data["settings"]["collective"] = "exact"
    world = sum(d.get("count", 1) for d in data["devices"])
    data["calibration"] = {**CALIBRATION, "compute_scale": [1.0] * world}
    cluster = cluster_from_dict(data)
    assert type(cluster.settings.collective) is Collective
    assert all(type(d.source) is ProfileSource for d in cluster.devices)
    assert type(cluster.calibration.source) is ProfileSource and cluster.calibration.mode is Schedule.UNIFORM
    path = tmp_path / "cluster.yaml"
    save_cluster(cluster, path)  # YAML's safe dumper refuses a str subclass: the writer gives the values
    assert load_cluster(path) == cluster
    assert "!!python" not in path.read_text()


def test_every_user_facing_choice_lists_exactly_its_vocabulary_and_auto():
    assert get_args(ScheduleChoice) == (AUTO, *values_of(Schedule)) == MODES
    assert get_args(CollectiveChoice) == (AUTO, *values_of(Collective)) == COLLECTIVES
    assert get_args(HandbackChoice) == (AUTO, *values_of(Handback)) == HANDBACKS
    strategy = inspect.signature(CephaloStrategy.__init__).parameters
    fabric = inspect.signature(CephaloFabricStrategy.__init__).parameters
    hints = typing.get_type_hints(CephaloStrategy.__init__)
    assert hints["mode"] is ScheduleChoice and hints["collective"] is CollectiveChoice
    assert hints["gather_on_teardown"] == HandbackChoice | bool  # True and False: what it took before its choices
    assert strategy["gather_on_teardown"].default == AUTO
    assert typing.get_type_hints(CephaloFabricStrategy.__init__)["collective"] is CollectiveChoice
    assert strategy["mode"].default == AUTO and strategy["collective"].default == AUTO == fabric["collective"].default
