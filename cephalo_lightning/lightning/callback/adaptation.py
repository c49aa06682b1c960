"""What the callback does after each watch window: calibrate once, report drift, follow stragglers.

* **Calibration** (once, after ``calibrate_after_windows`` windows past the first): rank 0 fits the
  cost model's run-time terms to the windows (:func:`.run_model.calibrate`), every rank adopts the
  calibrated cluster, and the calibrated optimum replaces the plan in place when it is predicted
  faster by more than ``switch_gain``.
* **Drift** is reported once per episode (:class:`.run_model.DriftEpisodes`).
* **Stragglers** (``adapt``, once calibrated): a rank drifting in two windows in a row (one
  window of noise moves nothing, and another rank's one window of noise beside it delays nothing),
  or in one window beyond the drift threshold twice over (x1.69 or /1.69 at the default 0.3: the
  median of a window's steps, which one slow step does not move), is re-timed from its own
  measured busy time (its compute scale multiplied by measured / predicted; no re-profile), the plan is
  re-solved, and the state moves in place when the new optimum is predicted faster than the current
  plan by more than ``switch_gain``. A rank that recovers drifts the other way and is re-timed back;
  measured back near its calibrated speed (within ``drift_threshold``, or nearer to it than to its
  re-timed one) it takes that speed again exactly, so the plan moves back to the one measured
  before the change (not to one window's noisy figure). Hysteresis: no decision for ``min_dwell_windows`` windows after a switch
  (the first of them mixes the two plans); every switch is logged with its predicted gain and, one
  full window after it took effect, the measured one. No files are written.
* **Rollback**: a switch whose measured gain is negative beyond noise (slower by more than
  ``switch_gain`` plus both windows' own spread, :func:`noise`) is undone in place: the previous
  plan is scheduled again and the rollback logged with the predicted and the measured figures (not
  when a rank drifts from its prediction in the measuring window: a rank that changed speed there,
  not the plan, may have made the step slower, and the straggler path re-times it instead). The
  plan it left is then refused while the model's rank speeds stay those it was refused under (within
  ``drift_threshold``), so a mis-priced plan is not offered again and again; a rollback itself is
  never rolled back (it returns to a plan already measured).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from cephalo_lightning.lightning.callback.callback_config import CallbackConfig
from cephalo_lightning.lightning.callback.run_model import CalibrationResult, DriftEpisodes, calibrate, drifting_ranks, gain
from cephalo_lightning.lightning.fit.callback_api import CallbackAPI
from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.planner import plan as make_plan
from cephalo_lightning.planner.cost.calibration import with_calibration
from cephalo_lightning.planner.cost.calibration_fit import plan_label, predicted


@dataclass(frozen=True)
class Switch:
    """One plan switch: when it was decided, why, and (later) what it measured."""

    window: int  # index into the callback's history
    step: int
    reason: str
    predicted_gain: float
    measured_step_before_s: float
    plan: str
    measured_gain: float | None = None
    previous: Plan | None = None  # the plan it left (what a rollback returns to)
    target: Plan | None = None  # the plan it scheduled
    noise_before: float = 0.0  # the deciding window's relative spread (see noise)
    rollback: bool = False  # this switch undid the one before it
    rolled_back: bool = False  # this switch measured slower beyond noise and was undone


def noise(record: dict[str, Any]) -> float:
    """A window's relative spread: the median absolute deviation of its steps over their median
    (0 when the window does not say); two windows' gains differ by noise when within their sum."""
    return float(record.get("step_spread", 0.0))


def _key(plan: Plan) -> tuple[Any, ...]:
    return plan.mode, plan.ranks


def _same_speeds(a: Sequence[float], b: Sequence[float], threshold: float) -> bool:
    return all(max(x, y) <= min(x, y) * (1 + threshold) for x, y in zip(a, b))


def _recovered(measured: float, was: float, calibrated: float, threshold: float) -> bool:
    """Whether a re-timed rank's measured speed is back at its calibrated one: within ``threshold``
    of it, or nearer to it than to the speed it had (as ratios, so x3 slower and x3 faster are alike)."""
    if _same_speeds([measured], [calibrated], threshold):
        return True
    return abs(math.log(measured / calibrated)) < abs(math.log(measured / was))


class RunAdapter:
    """The callback's decisions after each window (see the module); the same on every rank."""

    def __init__(self, config: CallbackConfig) -> None:
        self.config = config
        self.calibration: CalibrationResult | None = None
        self.episodes = DriftEpisodes()
        self.switches: list[Switch] = []
        self._previous: tuple[int, ...] = ()  # the ranks the last window found drifting
        self._calibrate_at = 1 + config.calibrate_after_windows  # windows seen when calibrating (the first warms up)
        self._refused: dict[tuple[Any, ...], tuple[tuple[float, ...], Switch]] = {}  # rolled-back plans: speeds, switch

    def in_dwell(self, window: int) -> bool:
        last = self.switches[-1].window if self.switches else None
        return last is not None and window - last <= self.config.min_dwell_windows

    def after_window(self, trainer: pl.Trainer, strategy: CallbackAPI, cluster: Cluster | None,
                     history: list[dict[str, Any]], ratios: Sequence[float | None], reference: float | None,
                     replan: Callable[[], Cluster | None]) -> Cluster | None:
        """Collective. Returns the cluster the next windows are predicted by."""
        index, record = len(history) - 1, history[-1]
        if self._measured_gain(trainer, strategy, cluster, index, record):
            record["drifting"] = []  # rolled back: the next windows mix the plans again, no other decision now
            return cluster
        if self.in_dwell(index):
            record["drifting"] = []  # a window mixing two plans, or too soon after a switch: no decision
        drifting = record["drifting"]
        event = self.episodes.update(drifting)
        adapting = self.config.adapt and self.calibration is not None and not self.config.replan
        if event == "start":
            against = "its calibrated prediction" if self.calibration is not None else "the median rank's"
            names = ", ".join(f"rank {i} ({ratios[i] / reference:.2f}x {against})" for i in drifting)  # type: ignore[operator]
            action = ("re-planning" if self.config.replan else "re-timing it from its measured spans" if adapting
                      else "CephaloCallback(replan=True) would re-plan")
            rank_zero_warn(f"Cephalo: {names} drifted from the plan by more than {self.config.drift_threshold:.0%}; "
                           f"{action}. Said once until the drifting ranks change.")
            if self.config.replan:
                cluster = replan()
                if self.calibration is not None:  # a new profile: calibrate it again, after a window of both plans
                    self.calibration = None
                    self._calibrate_at = len(history) + 1 + self.config.calibrate_after_windows
        elif event == "end":
            rank_zero_info("Cephalo: every rank is within the drift threshold of its prediction again.")
        # not noise: a rank drifting in two windows in a row (whichever other rank drifted beside it
        # once), or one window's median step beyond the drift threshold twice over
        far, _ = drifting_ranks(ratios, (1 + self.config.drift_threshold) ** 2 - 1, self.calibration is not None)
        confirmed = [i for i in drifting if i in self._previous or i in far]
        self._previous = tuple(drifting)
        if adapting and confirmed and cluster is not None:
            cluster = self._retime(trainer, strategy, cluster, ratios, confirmed, index, record)
            self._previous = ()
        windows = self.config.calibrate_after_windows
        if windows and self.calibration is None and cluster is not None and len(history) == self._calibrate_at:
            cluster = self._calibrate(trainer, strategy, cluster, history[-windows:], index, record)
        return cluster

    def _calibrate(self, trainer: pl.Trainer, strategy: CallbackAPI, cluster: Cluster,
                   windows: list[dict[str, Any]], index: int, record: dict[str, Any]) -> Cluster:
        assert strategy.plan is not None
        # each rank's windows hold its own step walls: rank 0's fit, for every rank
        result = strategy.broadcast(calibrate(cluster, strategy.plan, windows) if trainer.is_global_zero else None)
        self.calibration = result
        if trainer.is_global_zero:
            rank_zero_info(result.message())
            for logger in trainer.loggers:
                logger.log_metrics(result.metrics(), step=trainer.global_step)
        self._offer(trainer, strategy, result.cluster, index, record, "calibrated optimum")
        return result.cluster

    def _retime(self, trainer: pl.Trainer, strategy: CallbackAPI, cluster: Cluster, ratios: Sequence[float | None],
                drifting: Sequence[int], index: int, record: dict[str, Any]) -> Cluster:
        calibration = cluster.calibration
        assert calibration is not None
        scales = list(calibration.compute_scale)
        calibrated = self._calibrated_speeds()
        back = []
        for i in drifting:
            was, scales[i] = scales[i], scales[i] * ratios[i]  # type: ignore[operator]
            # a rank measured back near its calibrated speed (within the drift threshold, or nearer
            # to it than to the speed it was re-timed to) has recovered: it takes that speed again,
            # not this window's figure (one plan's steps, perhaps a small batch, measured on a noisy
            # host), so the plan returns to the one the run measured before the rank changed
            if i < len(calibrated) and _recovered(scales[i], was, calibrated[i], self.config.drift_threshold):
                scales[i] = calibrated[i]
                back.append(i)
        retimed = with_calibration(cluster, replace(calibration, compute_scale=tuple(scales)))
        shown = ", ".join(f"rank {i} x{scales[i]:.2f}" + (" (its calibrated speed again)" if i in back else "")
                          for i in drifting)
        rank_zero_info(f"Cephalo: re-timed from measured busy time (compute scale against the profile: {shown}); "
                       "re-solving the plan")
        self._offer(trainer, strategy, retimed, index, record, "re-timed " + ", ".join(f"rank {i}" for i in drifting))
        return retimed

    def _offer(self, trainer: pl.Trainer, strategy: CallbackAPI, cluster: Cluster, index: int,
               record: dict[str, Any], reason: str) -> None:
        """Switch in place to ``cluster``'s optimum when it beats the current plan by more than ``switch_gain``."""
        current = strategy.plan
        assert current is not None
        best: Plan = strategy.broadcast(make_plan(cluster, current.global_batch_size, mode=current.mode)
                                        if trainer.is_global_zero else None)
        faster = gain(predicted(cluster, current)[0], best.predicted_step_s)
        if faster <= self.config.switch_gain or best.ranks == current.ranks:
            rank_zero_info(f"Cephalo: {reason}: the best plan is predicted {faster:.1%} faster than the current one "
                           f"(switch_gain {self.config.switch_gain:.0%}); keeping it.")
            return
        speeds = self._speeds(cluster)
        refused = self._refused.get(_key(best))
        if refused is not None and _same_speeds(refused[0], speeds, self.config.drift_threshold):
            was = refused[1]
            rank_zero_info(f"Cephalo: {reason}: the best plan, {plan_label(best)} (predicted {faster:.1%} faster), was "
                           f"rolled back at step {was.step} (predicted {was.predicted_gain:+.1%}, measured "
                           f"{was.measured_gain:+.1%}) and the ranks' speeds have not changed since; keeping the "
                           "current plan.")
            return
        epoch, step = strategy.schedule_plan(best)
        self.switches.append(Switch(index, trainer.global_step, reason, faster, record["step_s"], plan_label(best),
                                    previous=current, target=best, noise_before=noise(record)))
        rank_zero_info(f"Cephalo: {reason}: switching in place to {plan_label(best)} from epoch {epoch} step {step}, "
                       f"predicted {faster:.1%} faster (no files written).")

    def _calibrated_speeds(self) -> tuple[float, ...]:
        """Every rank's compute scale as the run's calibration found it (before any re-timing)."""
        return self._speeds(self.calibration.cluster) if self.calibration is not None else ()

    @staticmethod
    def _speeds(cluster: Cluster | None) -> tuple[float, ...]:
        calibration = cluster.calibration if cluster is not None else None
        return calibration.compute_scale if calibration is not None else ()

    def _measured_gain(self, trainer: pl.Trainer, strategy: CallbackAPI, cluster: Cluster | None, index: int,
                       record: dict[str, Any]) -> bool:
        """One full window after a switch took effect: what it measured against the window before it;
        a switch slower beyond noise is rolled back (see the module). True when it rolled back."""
        if not self.switches or self.switches[-1].measured_gain is not None:
            return False
        last = self.switches[-1]
        if index != last.window + 2:  # window + 1 mixes the two plans
            return False
        # each rank's windows hold its own step walls: rank 0's figures decide, for every rank
        measured, tolerance, now_s = strategy.broadcast(
            (last.measured_step_before_s / record["step_s"] - 1.0, self.config.switch_gain + last.noise_before
             + noise(record), record["step_s"]) if trainer.is_global_zero else None)
        # a rank drifting from its prediction in this window changed speed: the window measures that
        # change with the switch, so it cannot undo the switch (the straggler path re-times the rank)
        drifting = list(record.get("drifting", ()))
        slower = measured < -tolerance and not last.rollback and last.previous is not None
        undo = slower and not drifting
        self.switches[-1] = last = replace(last, measured_gain=measured, rolled_back=undo)
        if not undo:
            confounded = (f"; not rolled back: {', '.join(f'rank {i}' for i in drifting)} drifted from the prediction "
                          "in the same window, which the figure measures too") if slower else ""
            rank_zero_info(f"Cephalo: the switch at step {last.step} ({last.reason}) measured {measured:+.1%} "
                           f"(predicted {last.predicted_gain:+.1%}){confounded}.")
            return False
        assert last.previous is not None and last.target is not None
        self._refused[_key(last.target)] = (self._speeds(cluster), last)
        epoch, step = strategy.schedule_plan(last.previous)
        self.switches.append(Switch(index, trainer.global_step, f"rolled back: {last.reason}", -measured / (1 + measured),
                                    now_s, plan_label(last.previous), rollback=True, target=last.previous))
        rank_zero_warn(f"Cephalo: the switch at step {last.step} ({last.reason}) was predicted {last.predicted_gain:+.1%} "
                       f"faster but measured {measured:+.1%} (step {last.measured_step_before_s:.4f} s -> "
                       f"{now_s:.4f} s, beyond the noise of {tolerance:.1%}); rolling back in place to "
                       f"{plan_label(last.previous)} from epoch {epoch} step {step}. That plan is not offered again while "
                       "the ranks' speeds stay as they are.")
        return True
