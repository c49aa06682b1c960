"""Every option of ``CephaloStrategy(...)`` and ``CephaloCallback(...)`` is checked at construction
(type and range, a refusal naming the option, what was given and what to write), a
``training_step`` that does not return the loss is named on its first call, and the data order
follows Lightning's seed convention (``seed=``, else ``seed_everything``'s ``PL_GLOBAL_SEED``)."""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything

from cephalo_lightning import CephaloCallback, CephaloStrategy
from cephalo_lightning._common.errors import ConfigurationError
from cephalo_lightning.lightning.callback.callback_config import CallbackConfig
from cephalo_lightning.lightning.fit.plan_resolution import data_seed
from cephalo_lightning.lightning.strategy_config import MAX_SEED, StrategyConfig
from cephalo_lightning.planner import Settings
from tests.helpers import fit
from tests.helpers import trainer as make_trainer
from tests.library_models import LibraryLM, PaddedTokens
from tests.library_models import loader as library_loader
from tests.lightning_models import TinyUniform, loader, token_data
from tests.plans import plan_of

# ----------------------------------------------------------------------------- the strategy's options

STRATEGY_BOOLS = ("prefetch", "overlap", "verify_loss", "check_devices", "verify_checksums", "async_checkpoint",
                  "elastic", "checkpoint_frozen", "fault_tolerance")
CALLBACK_BOOLS = ("force_profile", "replan", "adapt", "print_plan", "quiet")


def test_the_bool_tables_cover_every_bool_option() -> None:
    assert {f.name for f in fields(StrategyConfig) if isinstance(f.default, bool)} == set(STRATEGY_BOOLS)
    assert {f.name for f in fields(CallbackConfig) if isinstance(f.default, bool)} == set(CALLBACK_BOOLS)


@pytest.mark.parametrize("name", [*STRATEGY_BOOLS, "offload"])
@pytest.mark.parametrize("given", ["no", "false", "yes", 0, 1])
def test_a_strategy_bool_option_takes_only_true_or_false(name: str, given: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        CephaloStrategy(**{name: given})
    message = str(refused.value)
    assert f"CephaloStrategy({name}={given!r}) must be True" in message
    assert f"write {name}=True or {name}=False" in message


@pytest.mark.parametrize(("arguments", "message"), [
    ({"units": [123]}, r"units=\[\.\.\., 123, \.\.\.\]\): 123 is not an nn\.Module subclass; .*units=\[MyBlock\]"),
    ({"units": ["torch.nn.functional.relu"]}, r"'torch\.nn\.functional\.relu' is not an nn\.Module subclass"),
    ({"units": "torch.nn.Linear"}, r"units='torch\.nn\.Linear'\) must be a non-empty list .*units=\['pkg\.mod\.MyBlock'\]"),
    ({"units": ["no.such.Block"]}, r"cannot import module class 'no\.such\.Block'"),
    ({"safe_globals": "MyClass"}, r"safe_globals='MyClass'\) must be a list of classes .*write safe_globals=\[MyClass\]"),
    ({"safe_globals": [3]}, r"safe_globals=\[\.\.\., 3, \.\.\.\]\): 3 is not a class or function; write"),
    ({"seed": 2**70}, rf"seed={2**70}\) must be an integer in \[0, 2\*\*63 - 1\] \(torch's seed range.*e\.g\. seed=42"),
    ({"seed": -1}, r"seed=-1\) must be an integer in \[0, 2\*\*63 - 1\]"),
    ({"seed": "7"}, r"seed='7'\) must be an integer in"),
    ({"plan": 123}, r"plan=123\) must be a Plan or the path of a plan file .*got int; write plan='plan\.json'"),
    ({"plan": {"ranks": []}}, r"plan=\{'ranks': \[\]\}\) must be a Plan .*got dict"),
    ({"cluster": 1.5, "global_batch_size": 8}, r"cluster=1\.5\) must be a Cluster .*write cluster='cluster\.yaml'"),
    ({"global_batch_size": "16"}, r"global_batch_size='16'\) must be an integer >= 1"),
    ({"max_nonfinite_skips": 2.5}, r"max_nonfinite_skips=2\.5\) must be an integer >= 0"),
    ({"param_dtype": ["bf16"]}, r"param_dtype=\['bf16'\]\): choose one of"),
    ({"pretrained": 3}, r"pretrained=3\) must be a path"),
    ({"gather_on_teardown": "yes"}, r"gather_on_teardown='yes'\): choose one of 'auto', 'all', 'rank0', 'none' \(True is "
                                    r"'all', False 'none'\)"),
    ({"gather_on_teardown": 1}, r"gather_on_teardown=1\): choose one of"),
    ({"gather_on_teardown": None}, r"gather_on_teardown=None\): choose one of"),
    ({"checkpoint_frozen": False}, r"checkpoint_frozen=False\) saves the trainable parameters only, and a resume reads "
                                   r"the frozen ones from pretrained=, which is not given: add pretrained=PATH"),
])
def test_bad_strategy_options_are_refused_with_the_fix(arguments: dict, message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        CephaloStrategy(**arguments)
    assert re.search(message, str(refused.value)), str(refused.value)


def test_a_checkpoint_of_the_trainable_parameters_is_a_sharded_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"checkpoint_frozen=False, state_dict_type='full'\): a single-file "
                                                 r"checkpoint is the whole model; use state_dict_type='sharded'"):
        CephaloStrategy(checkpoint_frozen=False, pretrained=tmp_path, state_dict_type="full")
    assert CephaloStrategy(checkpoint_frozen=False, pretrained=tmp_path).config.checkpoint_frozen is False


def test_gather_on_teardown_takes_its_choices_and_the_bools_it_took_before() -> None:
    from cephalo_lightning._common.vocabulary import AUTO, Handback

    taken = {given: CephaloStrategy(gather_on_teardown=given).config.gather_on_teardown
             for given in (True, False, "auto", "all", "rank0", "none")}
    assert taken == {True: Handback.ALL, False: Handback.NONE, "auto": AUTO, "all": Handback.ALL,
                     "rank0": Handback.RANK0, "none": Handback.NONE}
    assert type(taken["rank0"]) is Handback and CephaloStrategy().config.gather_on_teardown == AUTO


def test_good_strategy_options_are_still_taken(tmp_path: Path) -> None:
    plan = plan_of(batches=[4], micro=[1], shares=[1.0], mode="uniform")
    plan.save(tmp_path / "plan.json")
    config = CephaloStrategy(plan=tmp_path / "plan.json", units=["torch.nn.Linear", torch.nn.GRU],
                             safe_globals={Path}, seed=MAX_SEED, offload=None, prefetch=False).config
    assert config.plan == plan and config.units == (torch.nn.Linear, torch.nn.GRU)
    assert config.safe_globals == (Path,) and config.seed == MAX_SEED and config.offload is None
    assert CephaloStrategy(offload=False, seed=0, safe_globals=[Path, print]).config.safe_globals == (Path, print)
    torch.Generator().manual_seed(MAX_SEED + 1000)  # the largest seed leaves room for the data epochs


# ----------------------------------------------------------------------------- the callback's options


@pytest.mark.parametrize("name", CALLBACK_BOOLS)
@pytest.mark.parametrize("given", ["no", "false", 1])
def test_a_callback_bool_option_takes_only_true_or_false(name: str, given: object) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(f"CephaloCallback({name}={given!r}) must be True or False")):
        CephaloCallback(**{name: given})


@pytest.mark.parametrize(("arguments", "message"), [
    ({"settings": {"usable_memory_fraction": 5}}, r"settings=\{'usable_memory_fraction': 5\}\): .*usable_memory_fraction must be <= 1"),
    ({"settings": {"usable_memory_fraction": 0}}, r"usable_memory_fraction must be > 0"),
    ({"settings": {"usable_memory_fraction": "0.9"}}, r"usable_memory_fraction must be a number, got '0\.9'"),
    ({"settings": {"usable_memory_fracton": 0.9}}, r"no setting 'usable_memory_fracton': did you mean 'usable_memory_fraction'\?"),
    ({"settings": {"reserved_gb": 1}}, r"no setting 'reserved_gb': did you mean 'reserved_memory_gb'\?"),
    ({"settings": {"overlap": 2}}, r"settings\.overlap must be in \[0, 1\]"),
    ({"settings": {"offload_stash": "no"}}, r"settings\.offload_stash must be true or false, got 'no'"),
    ({"settings": {"collective": "ring"}}, r"settings\.collective must be one of \('padded', 'exact'\)"),
    ({"settings": {"link_bandwidth_gbps": -3}}, r"settings\.link_bandwidth_gbps must be > 0"),
    ({"settings": "usable_memory_fraction=0.9"}, r"must be a mapping of cost-model settings, got str; write e\.g\. settings="),
    ({"state_bytes_per_param": "16"}, r"state_bytes_per_param='16'\) must be a number > 0"),
    ({"state_bytes_per_param": 0}, r"state_bytes_per_param=0\) must be a number > 0"),
    ({"drift_threshold": "0.3"}, r"drift_threshold='0\.3'\): watch_every_n_steps must be >= 0 and drift_threshold > 0"),
    ({"drift_threshold": float("nan")}, r"drift_threshold=nan\): "),
    ({"watch_every_n_steps": 2.5}, r"watch_every_n_steps=2\.5, .*must be >= 0"),
    ({"max_micro_batch": "4"}, r"max_micro_batch='4'\) must be an integer >= 1"),
    ({"cache_dir": 3}, r"cache_dir=3\) must be a path"),
    ({"plan_file": ""}, r"plan_file=''\) must be a path \(a non-empty str or Path\) or None"),
    ({"cluster_file": "/proc/cephalo/cluster.yaml"},
     r"cluster_file='/proc/cephalo/cluster\.yaml'\): cluster_file '/proc/cephalo/cluster\.yaml': cannot write in '/proc' "
     r"\(.*\); choose another cluster_file"),
    ({"cluster_file": __file__ + "/cluster.yaml"}, r"\.py' is a file, not a folder; choose another cluster_file"),
    ({"plan_file": "."}, r"plan_file '\.' is a directory; give a file name, e\.g\. plan_file plan\.json"),
])
def test_bad_callback_options_are_refused_at_construction(arguments: dict, message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        CephaloCallback(**arguments)
    assert re.search(message, str(refused.value)), str(refused.value)
    assert str(refused.value).startswith("CephaloCallback(")


def test_good_callback_settings_are_kept_as_the_cost_model_takes_them() -> None:
    config = CallbackConfig(settings={"usable_memory_fraction": 1, "link_bandwidth_gbps": None, "offload_stash": True})
    assert config.settings == {"usable_memory_fraction": 1.0, "link_bandwidth_gbps": None, "offload_stash": True}
    assert replace(Settings(), **config.settings).usable_memory_fraction == 1.0  # what on_fit_start does with them
    assert CallbackConfig(cache_dir=Path("x"), plan_file="p.json").cache_dir == Path("x")


# ----------------------------------------------------------------------------- training_step's output

ONE_RANK = plan_of(batches=[4], micro=[2], shares=[1.0], mode="uniform")


class Returns(TinyUniform):
    """TinyUniform whose ``training_step`` returns what ``shape`` makes of its loss."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape = shape

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return self.shape(self.model.loss(logits, y), logits)


@pytest.mark.parametrize(("shape", "message"), [
    (lambda loss, logits: {"logits": logits}, r"returned a dict without a 'loss' key \(keys: \['logits'\]\)"),
    (lambda loss, logits: loss.item(), r"returned \d\.\d+ \(a float\); .*not loss\.item\(\) or float\(loss\)"),
    (lambda loss, logits: {"loss": float(loss)}, r"returned a dict whose 'loss' is \d\.\d+ \(a float\)"),
    (lambda loss, logits: logits.logsumexp(-1).mean(-1), r"returned a tensor of shape \(2,\) \(reduce it to one value"),
])
def test_a_training_step_that_does_not_return_the_loss_is_named_on_its_first_call(shape, message) -> None:
    with pytest.raises(ConfigurationError, match=message) as refused:
        fit(Returns(shape), ONE_RANK, 1, 1, token_data(8), mode="uniform")
    assert "return {'loss': loss, ...}" in str(refused.value)


@pytest.mark.parametrize("mode", ["uniform", "layered"])  # layered: the discovered blocks' first-step check runs it
@pytest.mark.parametrize(("shape", "message"), [
    (lambda loss, logits: None,
     r"training_step returned None, which Lightning takes as 'skip this batch'; Lightning documents skipping a batch "
     r"as unsupported on several devices, .*no rank can skip\. Return the loss"),
    (lambda loss, logits: {"logits": logits}, r"returned a dict without a 'loss' key \(keys: \['logits'\]\)"),
])
def test_none_or_a_dict_without_loss_is_named_in_either_mode(mode: str, shape, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as refused:
        fit(Returns(shape), ONE_RANK, 1, 1, token_data(8), mode=mode)
    assert "return {'loss': loss, ...}" in str(refused.value)


class Doubled(LibraryLM):
    """A model the adapter finds (its own loss computed layer by layer) whose training_step returns another objective."""

    def training_step(self, batch, batch_idx):
        return 2 * super().training_step(batch, batch_idx)


def test_a_training_step_computing_another_objective_is_refused_on_the_layered_first_step() -> None:
    plan, data = plan_of(batches=[4], micro=[2], shares=[1.0]), PaddedTokens(8)
    with torch.no_grad():  # the reference: the model's own loss on the first micro-batch, outside the package
        want = float(LibraryLM("llama").model(**data.batch(0, 2)).loss)
    with pytest.raises(ConfigurationError, match="computes a different objective") as refused:
        make_trainer(CephaloStrategy(plan=plan), 1, 1).fit(Doubled("llama"), library_loader(data, 4))
    got, own = map(float, re.search(r"returned (\S+) where the model's own loss is (\S+) on", str(refused.value)).groups())
    assert own == pytest.approx(want, rel=1e-5) and got == pytest.approx(2 * want, rel=1e-5)
    trainer = make_trainer(CephaloStrategy(plan=plan, verify_loss=False), 1, 1)
    trainer.fit(Doubled("llama"), library_loader(data, 4))  # the check skipped: the model's own loss trains
    assert trainer.global_step == 1


def test_a_training_step_returning_a_dict_with_its_loss_still_trains() -> None:
    trainer = fit(Returns(lambda loss, logits: {"loss": loss, "logits": logits.detach()}), ONE_RANK, 1, 1,
                  token_data(8), mode="uniform")
    assert trainer.global_step == 1


# ----------------------------------------------------------------------------- the data order's seed

SEED, GLOBAL_BATCH, SAMPLES = 7, 8, 32


class Records(TinyUniform):
    """Reseeds torch while it is built (as a model's own init may) and records the batches it trains on."""

    def __init__(self, reseed: int) -> None:
        torch.manual_seed(reseed)
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return super().training_step(batch, batch_idx)


def _order(reseed: int, **strategy) -> torch.Tensor:
    module = Records(reseed)
    plan = plan_of(batches=[GLOBAL_BATCH], micro=[1], shares=[1.0], mode="uniform")
    data = token_data(SAMPLES)
    make_trainer(CephaloStrategy(plan=plan, mode="uniform", **strategy), 1, 2).fit(
        module, loader(data, GLOBAL_BATCH, shuffle=True))
    return torch.cat(module.seen)


def test_the_data_order_follows_seed_everything_not_a_later_manual_seed() -> None:
    data = token_data(SAMPLES)
    expected = data.tensors[0][torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED))[:16]]
    seed_everything(SEED, verbose=False)
    first = _order(reseed=1)
    seed_everything(SEED, verbose=False)
    second = _order(reseed=2)
    assert torch.equal(first, second), "a torch.manual_seed call in the model's constructor changed the data order"
    assert torch.equal(first, expected)  # seed_everything(s) shuffles as CephaloStrategy(seed=s) does


def test_an_explicit_seed_wins_over_seed_everything() -> None:
    data = token_data(SAMPLES)
    expected = data.tensors[0][torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(3))[:16]]
    seed_everything(SEED, verbose=False)
    assert torch.equal(_order(reseed=1, seed=3), expected)


def test_the_data_seed_convention() -> None:
    assert data_seed(3, {"PL_GLOBAL_SEED": "7"}) == 3
    assert data_seed(None, {"PL_GLOBAL_SEED": "7"}) == 7
    assert data_seed(None, {}) is None  # the caller takes torch.initial_seed() at setup
    with pytest.raises(ConfigurationError, match=r"PL_GLOBAL_SEED='seven' is not a seed .*seed_everything\(42\)"):
        data_seed(None, {"PL_GLOBAL_SEED": "seven"})


def test_a_pipelined_plan_is_refused_where_it_cannot_run_naming_the_fix():
    from types import SimpleNamespace

    from cephalo_lightning._common.errors import UnsupportedError
    from cephalo_lightning.lightning.steps.schedules import check_plan
    from cephalo_lightning.lightning.strategy.fabric import _check_plan

    plan = SimpleNamespace(stage_layers=(2, 3), pipelined=True, idle_ranks=())  # what a pipelined plan adds
    with pytest.raises(UnsupportedError, match=r"pipelined \(2 stages of \[2, 3\] layers\).*CephaloFabricStrategy cannot "
                                               r"run.*Trainer\(strategy=CephaloStrategy\(plan=\.\.\.\)\).*--no-pipelines"):
        _check_plan(plan, None)
    manual = TinyUniform()
    manual.automatic_optimization = False
    for mode, module, why in (("uniform", TinyUniform(), "the uniform mode"), ("layered", manual, "manual")):
        with pytest.raises(UnsupportedError, match=rf"runs in the layered mode only \({why}.*--no-pipelines"):
            check_plan(plan, mode, None, module)
    check_plan(plan, "layered", None, TinyUniform())  # the Trainer's layered steps run it


def _subset_plan():
    """A plan over two ranks that leaves rank 1 idle (the planner's subset plans): rank 0 computes alone."""
    from cephalo_lightning.planner import Plan, RankPlan

    return Plan(4, "layered", (RankPlan(0, "a100-40gb", 4, 2, 2, 1.0), RankPlan(1, "rtx3090", 0, 1, 0, 0.0, idle=True)))


def test_a_plan_with_idle_ranks_is_refused_at_setup_naming_them_and_the_fix(tmp_path) -> None:
    from cephalo_lightning._common.errors import UnsupportedError
    from cephalo_lightning.lightning.steps.schedules import check_plan
    from cephalo_lightning.lightning.strategy.fabric import _check_plan

    plan = _subset_plan()
    fix = r"ranks \[1\] idle .*ranks \[0\] alone.*Launch only the busy GPUs with a plan made for them.*--no-subsets"
    # the busy GPU launched alone with the subset plan: named before the world size, which would send it elsewhere
    plan.save(tmp_path / "plan.json")
    with pytest.raises(UnsupportedError, match=fix):
        make_trainer(CephaloStrategy(plan=tmp_path / "plan.json"), 1, 1).fit(TinyUniform(), loader(token_data(8), 4))
    for check in (lambda p: check_plan(p, None, None, None), lambda p: _check_plan(p, None)):  # re-plans, Fabric
        with pytest.raises(UnsupportedError, match=fix):
            check(plan)
    check_plan(replace(plan, ranks=plan.ranks[:1]), "layered", None, TinyUniform())  # its busy rank alone runs


@pytest.mark.parametrize(("options", "problem"), [
    ({"fault_tolerance": True}, r"fault_tolerance=True\) cannot run a pipelined plan .*drop fault_tolerance=True"),
    ({"elastic": True}, r"elastic=True\) cannot run a pipelined plan"),
    ({"async_checkpoint": True}, r"async_checkpoint=True\) cannot run a pipelined plan"),
    ({"state_dict_type": "full"}, r"state_dict_type='full'\) cannot run a pipelined plan"),
    ({"checkpoint_frozen": False}, r"checkpoint_frozen=False\) cannot run a pipelined plan"),
    ({"gather_on_teardown": "all"}, r"gather_on_teardown='all'\) cannot run a pipelined plan .*consolidate"),
])
def test_what_a_pipelined_plan_cannot_run_with_is_refused_at_setup(options, problem) -> None:
    from cephalo_lightning._common.errors import UnsupportedError
    from cephalo_lightning.lightning.fit.fit_runtime import refuse_pipelined_options

    refuse_pipelined_options(CephaloStrategy().config)  # the defaults run it
    with pytest.raises(UnsupportedError, match=problem + r".*--no-pipelines"):
        refuse_pipelined_options(replace(CephaloStrategy().config, **options))


def test_what_a_pipelined_fit_cannot_do_yet_is_refused_before_it_trains() -> None:
    from cephalo_lightning._common.errors import UnsupportedError
    from cephalo_lightning.lightning.fit.fit_runtime import refuse_pipelined_fit

    refuse_pipelined_fit(make_trainer(CephaloStrategy(), 1, 1, enable_checkpointing=True), callback=False)
    cases = [(make_trainer(CephaloStrategy(), 1, 1, accumulate_grad_batches=2), False, "larger global batch"),
             (make_trainer(CephaloStrategy(), 1, 1), True, r"drop the callback")]
    for trainer, callback, problem in cases:
        with pytest.raises(UnsupportedError, match=problem):
            refuse_pipelined_fit(trainer, callback)


def test_a_pipelined_plan_needs_layers_the_strategy_knows() -> None:
    from types import SimpleNamespace

    from cephalo_lightning._common.errors import UnsupportedError
    from cephalo_lightning.lightning.fit.fit_runtime import _pipeline

    config = CephaloStrategy().config
    discovered = SimpleNamespace(name="Olmo2ForCausalLM", discovery=object())
    for layered, problem in ((None, "runs in the layered mode"), (discovered, r"Olmo2ForCausalLM's layers were discovered")):
        with pytest.raises(UnsupportedError, match=problem + r".*re-plan without pipelines"):
            _pipeline(TinyUniform(), None, config, layered, None, torch.device("cpu"), None)


def test_a_plan_switch_to_or_from_a_pipelined_plan_is_refused() -> None:
    from types import SimpleNamespace

    from cephalo_lightning._common.errors import UnsupportedError
    from cephalo_lightning.lightning.fit.fit_runtime import FitRuntime

    runtime = FitRuntime.__new__(FitRuntime)  # what _check_switch reads: the stage this fit runs, if any
    for held, new in ((None, SimpleNamespace(pipelined=True)), (object(), SimpleNamespace(pipelined=False))):
        runtime.pipeline = held
        with pytest.raises(UnsupportedError, match=r"plan switch to or from a pipelined plan.*--no-pipelines"):
            runtime._check_switch(new, None)
