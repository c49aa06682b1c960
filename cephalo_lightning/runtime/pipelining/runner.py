"""One rank's stage of a pipelined plan: its layers sharded over its stage's ranks, run by a schedule.

One optimizer step of rank (d, s) (pipeline d, stage s), its pipeline's micro-batches k = 0..M_d-1:

    N       = all-reduce over every rank of the items (samples or tokens) of the pipelines' batches
    gather  every unit of the stage, in order, over the stage's ranks (the stage's shard group)
    F k     x = the micro-batch's input (s = 0) or the hidden state received from stage s-1;
            run the stage's layers; send the output to stage s+1, or (last stage) compute
            loss_k = (summed loss of micro-batch k) / N
    B k     backpropagate loss_k (last stage) or the gradient received from stage s+1; send the
            gradient of x to stage s-1 (s > 0)
    reduce  every unit's gradient, from the last to the first, reduce-scattered over the stage's ranks
    tied    a parameter held by several stages: its reduced pieces summed over those stages' ranks
    loss    all-reduce of the last stages' sum over k of loss_k: every rank returns the global loss

F and B come in the order of the schedule (:mod:`.schedule`); side inputs (attention masks, position
ids, rotary embeddings) are recomputed on every stage from the micro-batch, which every rank of the
pipeline holds, and never sent. Gradients add up over the micro-batches on the gathered parameters,
so the result is d(sum over the global batch of the per-item losses / N) whatever the layout: the
single-process gradient.

[Note: predictions through the pipeline] ``predict`` runs the forward passes of the pipeline's micro-batches without a
loss: the last stage keeps each micro-batch's last-layer output (a Hugging Face model's logits), and
sends their concatenation to every other rank of its pipeline, so each rank of pipeline d returns the
outputs of the samples it was given (its pipeline's). A stage gathers each unit once for the call
(no layer by layer: a pipeline may get fewer micro-batches than another).

[Note: collective order] Every rank of a stage gathers the same units in the same order, reduces
them in the same (reverse) order and takes part in the same all-reduces (the item count, the tied
parameters in a fixed order, the loss), whatever its micro-batch count, batch (zero too) or share.
Point-to-point transfers pair within a pipeline (:mod:`.transfer`, each logged).

[Note: a stage holds its units gathered for the step] A stage gathers each of its units once and
keeps them for the step (its micro-batches' activations too, as the schedule holds them: all M under
GPipe, at most S - s under 1F1B), then reduces each once: one all-gather and one reduce-scatter per
unit per step, whatever M. The price is the stage's whole gathered state in memory during the step.

[Note: layer by layer] With ``layer_by_layer`` (the default where every pipeline has the same
micro-batch count, the shape the planner prices) a stage instead gathers each layer for each
micro-batch: F k runs the layers without a graph, keeping each layer's input (and the random state);
B k gathers them again in reverse, recomputes each from its input, backpropagates and reduce-scatters
that micro-batch's gradient of the layer at once. A rank then holds one gathered layer (and the next,
prefetched) and, per micro-batch in flight, its layers' inputs; every rank of a stage issues the same
collectives, M x (2 all-gathers + 1 reduce-scatter) per layer less one all-gather per turn (below),
since its pipelines share M and so their actions. The root unit (parameters tied inside the stage)
stays gathered for the step and is reduced once.

[Note: a layer kept over a turn] A forward ends on the stage's last layer, where a backward starts,
and a backward ends on its first layer, where a forward starts: at such a turn of the schedule the
layer stays gathered instead of being freed and gathered again (still one gathered layer, as while
it computes). The stage's ranks run the same actions, so they skip the same gathers. 1F1B turns
2 (M - w) - 1 times on a stage with w warm-up forwards (w = min(M, S - s - 1); once where w = M), GPipe
once; the planner's price counts the gathers so (:mod:`cephalo_lightning.planner.cost.pipeline_cost`).

[Note: why not torch.distributed.pipelining] Its ``PipelineStage`` composes with sharded units as far
as gathering before the schedule and reducing after it goes, and its schedules are exact with
``scale_grads=False``, but it infers one set of receive shapes for every micro-batch (from the first),
while a plan's micro-batches differ in size (a batch of 5 in 2 is 3 + 2); it hands a later stage only
what the stage before sent, so side inputs (masks, position ids, rotary tables) would have to travel
as activations; and its loss sees ``(output, target)`` alone, not the global item count a padded
batch's per-token mean needs. A schedule is two short lists per stage (:mod:`.schedule`), so this
runtime keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cephalo_lightning.runtime.collectives import Links
from cephalo_lightning.runtime.distributed import gather_objects
from cephalo_lightning.runtime.layered import Layer, Side
from cephalo_lightning.runtime.pipelining.schedule import Pass, stage_actions
from cephalo_lightning.runtime.pipelining.stages import PipelineLayout
from cephalo_lightning.runtime.pipelining.transfer import Transfers
from cephalo_lightning.runtime.pipelining.views import module_paths, stage_view, tied_across
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

Prepare = Callable[[Any], tuple[torch.Tensor, Side]]
# (last layer's output, micro-batch, side inputs, the global item count) -> the micro-batch's summed loss / count
WeightedLoss = Callable[[torch.Tensor, Any, Side, float], torch.Tensor]
Items = Callable[[Any], int]


@dataclass(frozen=True)
class _Tie:
    stages: tuple[int, ...]
    name: str  # the parameter's name in this rank's stage
    group: dist.ProcessGroup | None
    counted: bool  # this stage is the first holder: the parameter's norm is counted here


class PipelineRunner:
    """Rank ``dist.get_rank()``'s stage of ``layout`` over ``layers`` (the layered protocol's layers of
    ``model``, in order). Every rank of the default process group builds one, alike (process groups are
    created collectively). Build the optimizer from :meth:`parameters`."""

    def __init__(self, model: nn.Module, layers: Sequence[Layer | nn.Module], layout: PipelineLayout, *,
                 prepare: Prepare, loss: WeightedLoss, items: Items, compute_dtype: torch.dtype | None = None,
                 links: Links | None = None, record_collectives: bool = False, device: torch.device | None = None,
                 layer_by_layer: bool | None = None) -> None:
        """``layer_by_layer``: [Note: layer by layer]; None: where every pipeline has the same micro-batch count."""
        layers = [Layer.of(layer) for layer in layers]
        canonical = {id(p): name for name, p in model.named_parameters()}  # a tied parameter: its first name
        held = {id(p) for layer in layers for m in layer.modules for p in m.parameters()}
        outside = [name for name, p in model.named_parameters() if id(p) not in held]
        if outside:
            raise ValueError(f"parameters outside every layer ({outside[:3]}{' ...' if len(outside) > 3 else ''}) would "
                             "belong to no stage and never train: put the modules holding them into a layer")
        if sum(layout.stage_layers) != len(layers):
            raise ValueError(f"the layout's stages cover {sum(layout.stage_layers)} layers, the model has {len(layers)}: "
                             "re-plan for this model")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"the layout has {layout.world_size} ranks, the world {dist.get_world_size()}: launch "
                             "as many ranks as the plan has")
        same_count = len(set(layout.micro_batches)) == 1
        if layer_by_layer and not same_count:
            raise ValueError(f"layer_by_layer needs one micro-batch count in every pipeline (the stage's ranks gather "
                             f"together per micro-batch), the layout has {list(layout.micro_batches)}: pass "
                             "layer_by_layer=False (each stage gathered once a step) or re-plan")
        self.layer_by_layer = same_count if layer_by_layer is None else layer_by_layer
        self.layout = layout
        self.rank = dist.get_rank()
        self.stage = layout.stage_of(self.rank)
        self.pipeline = layout.pipeline_of(self.rank)
        self.previous, self.next = layout.neighbours(self.rank)
        self.layers = [layers[i] for i in layout.layer_range(self.stage)]
        self.prepare, self.loss, self.items = prepare, loss, items
        paths = module_paths(model)
        views = [stage_view(model, [m for i in layout.layer_range(s) for m in layers[i].modules], paths)
                 for s in range(layout.num_stages)]
        groups = [dist.new_group(list(layout.stage_ranks(s))) for s in range(layout.num_stages)]
        self.ties: list[_Tie] = []
        for stages, names in tied_across(views):  # the same order on every rank: groups are made collectively
            ranks = sorted(r for s in stages for r in layout.stage_ranks(s))
            group = dist.new_group(ranks)
            if self.stage in stages:
                self.ties.append(_Tie(stages, names[stages.index(self.stage)], group, stages[0] == self.stage))
        self.canonical = {name: canonical[id(p)] for name, p in views[self.stage].named_parameters(remove_duplicate=False)}
        stage_ranks = layout.stage_ranks(self.stage)
        self.sharded = ShardedModel(views[self.stage], [layout.shares[r] for r in stage_ranks],
                                    units=[list(layer.modules) for layer in self.layers], group=groups[self.stage],
                                    links=links, compute_dtype=compute_dtype, hooks=False,
                                    record_collectives=record_collectives, device=device)
        self.device = self.sharded.device
        self._cuda_devices = [self.device.index or 0] if self.device.type == "cuda" else []
        self.transfers = Transfers(self.device, links=links)
        _free_other_stages(layers, views[self.stage])

    # ------------------------------------------------------------------ what the optimizer and checks see

    def parameters(self) -> list[nn.Parameter]:
        """This rank's pieces of its stage's state."""
        return list(self.sharded.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.sharded.named_parameters())

    # ------------------------------------------------------------------ one step

    def train_step(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """Forward and backward of this pipeline's ``micro_batches`` (every rank of the pipeline passes
        the same); leaves every piece's reduced gradient. Returns the global batch's loss."""
        total = self._global_items(micro_batches)
        return self._run(micro_batches, total, train=True)

    def evaluate(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """The global batch's loss, forward only (validation): the same gathers, transfers of hidden
        states only, nothing reduced. A pipeline may evaluate in fewer micro-batches than it trains
        in (an evaluation batch of fewer samples), at least one; layer by layer, every pipeline of a
        stage in the same count."""
        total = self._global_items(micro_batches)
        return self._run(micro_batches, total, train=False)

    @torch.no_grad()
    def predict(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """[Note: predictions through the pipeline] The last layer's outputs of this pipeline's ``micro_batches`` (every rank of
        the pipeline passes the same, at least one; another pipeline may pass another count),
        concatenated along the first dimension, on every rank of the pipeline: forward only, each unit
        of the stage gathered once for the call."""
        sharded, observers = self.sharded, self.sharded.observers
        outputs: list[torch.Tensor] = []
        with sharded.scheduled():
            for index in range(len(sharded.units)):  # every rank of the stage alike, whatever its micro-batches
                sharded.gather(index, prefetch=index + 1)
            for k, micro_batch in enumerate(micro_batches):
                received = None if self.previous is None else self.transfers.recv(self.previous, Pass.FORWARD, k)
                with observers.compute("stage_forward"):
                    first_input, side = self.prepare(micro_batch)
                    h = first_input if received is None else received
                    for layer in self.layers:
                        h = layer(h, side)
                if self.next is None:
                    outputs.append(h)
                else:
                    self.transfers.send(h, self.next, Pass.FORWARD, k)
            self.transfers.flush()
            sharded.free_all()
        chain, handed = self.layout.pipelines[self.pipeline], len(micro_batches)  # a tag no micro-batch's send uses
        if self.next is not None:
            return self.transfers.recv(chain[-1], Pass.FORWARD, handed)
        out = torch.cat(outputs)
        for peer in chain[:-1]:
            self.transfers.send(out, peer, Pass.FORWARD, handed)
        self.transfers.flush()
        return out

    def _global_items(self, micro_batches: Sequence[Any]) -> float:
        """N: every pipeline's items counted once (by its first stage), summed over the world."""
        local = float(sum(self.items(mb) for mb in micro_batches)) if self.stage == 0 else 0.0
        count = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(count)
        return count.item()

    def _run(self, micro_batches: Sequence[Any], total: float, train: bool) -> torch.Tensor:
        expected = self.layout.micro_batches[self.pipeline] if self.layout.batch_sizes[self.pipeline] else 0
        if len(micro_batches) != expected and (train or not 0 < len(micro_batches) <= expected):
            raise ValueError(f"rank {self.rank} (pipeline {self.pipeline}, stage {self.stage}) got {len(micro_batches)} "
                             f"micro-batches, the layout gives its pipeline {expected}: cut the pipeline's batch with "
                             "layout.micro_batch_sizes(pipeline)")
        if self.layer_by_layer:
            loss_sum = self._run_layers(micro_batches, total, train)
        else:
            loss_sum = self._run_gathered(micro_batches, total, train)
        if train:
            self._sum_ties()
        dist.all_reduce(loss_sum)  # the last stages' sums; the others add zero
        return loss_sum

    def _actions(self, count: int, train: bool) -> list[Any]:
        actions = stage_actions(self.layout.schedule, self.stage, self.layout.num_stages, count)
        return actions if train else [a for a in actions if a.kind is Pass.FORWARD]

    def _agree(self, count: int) -> None:
        """Layer by layer, a stage's ranks gather and reduce once per action: one small all-reduce first
        makes a rank whose action count differs from the others' an error instead of a hang."""
        counts = torch.tensor([count, -count], dtype=torch.float64, device=self.device)
        self.sharded.comm.all_reduce_max(counts)
        if counts.tolist() != [count, -count]:
            raise RuntimeError(f"rank {self.rank} (stage {self.stage}) runs {count} forward and backward actions this "
                               f"step, another rank of its stage between {-counts[1].item():g} and {counts[0].item():g}: "
                               "the pipelines of a stage run layer by layer need one micro-batch count")

    def _run_gathered(self, micro_batches: Sequence[Any], total: float, train: bool) -> torch.Tensor:
        sharded, last = self.sharded, self.next is None
        observers = sharded.observers  # compute regions: an attached emulator stretches them (not the transfers)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with sharded.scheduled():
            for index in range(len(sharded.units)):
                sharded.gather(index, prefetch=index + 1)
            kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for action in self._actions(len(micro_batches), train):
                k = action.micro_batch
                if action.kind is Pass.FORWARD:
                    received = None if self.previous is None else self.transfers.recv(self.previous, Pass.FORWARD, k)
                    with torch.set_grad_enabled(train), observers.compute("stage_forward"):
                        x, out = self._forward(received, micro_batches[k], total)
                    if last:
                        loss_sum += out.detach().double()
                    else:
                        self.transfers.send(out, self.next, Pass.FORWARD, k)
                    if train:
                        kept[k] = (x, out)
                else:
                    x, out = kept.pop(k)
                    upstream = None if last else self.transfers.recv(self.next, Pass.BACKWARD, k)
                    with observers.compute("stage_backward"):
                        out.backward(upstream)
                    if self.previous is not None:
                        grad = x.grad if x.grad is not None else torch.zeros_like(x)
                        self.transfers.send(grad, self.previous, Pass.BACKWARD, k)
            self.transfers.flush()
            if train:
                for unit in reversed(sharded.units):  # [Note: collective order]
                    sharded.reduce_unit(unit)
                sharded.wait_reductions()
            sharded.free_all()
        return loss_sum

    def _run_layers(self, micro_batches: Sequence[Any], total: float, train: bool) -> torch.Tensor:
        """[Note: layer by layer]"""
        sharded, units, last = self.sharded, self.sharded.units, self.next is None
        observers, devices = sharded.observers, self._cuda_devices
        per_micro_batch = sharded.comm.world_size > 1  # a stage of one rank holds its units whole: reduce once
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        kept: dict[int, tuple[list[tuple[torch.Tensor, Any]], Any]] = {}
        actions = self._actions(len(micro_batches), train)
        self._agree(len(actions))
        # [Note: a layer kept over a turn] the kind of the action after each: a forward ending on the
        # last layer before a backward (which starts there), or a backward ending on the first layer
        # before a forward, keeps that layer gathered
        following = [b.kind for b in actions[1:]] + [None]
        with sharded.scheduled():
            sharded.gather_root()
            for action, after in zip(actions, following):
                k = action.micro_batch
                micro_batch = micro_batches[k]
                if action.kind is Pass.FORWARD:
                    received = None if self.previous is None else self.transfers.recv(self.previous, Pass.FORWARD, k)
                    sharded.gather(1, prefetch=2)
                    with torch.no_grad():
                        first_input, side = self.prepare(micro_batch)
                        h = first_input if received is None else received
                        stash = []
                        for index, layer in enumerate(self.layers, start=1):
                            sharded.gather(index, prefetch=index + 1)
                            stash.append((h, (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])))
                            with observers.compute("stage_forward"):
                                h = layer(h, side)
                            if not (index == len(self.layers) and after is Pass.BACKWARD):
                                units[index].free()
                        if last:
                            with observers.compute("stage_forward"):
                                loss_sum += self.loss(h, micro_batch, side, total).double()
                        else:
                            self.transfers.send(h, self.next, Pass.FORWARD, k)
                    if train:
                        kept[k] = (stash, side)
                    continue
                stash, side = kept.pop(k)
                upstream = None if last else self.transfers.recv(self.next, Pass.BACKWARD, k)
                for index in range(len(self.layers), 0, -1):
                    sharded.gather(index, prefetch=index - 1)
                    x, (cpu_rng, cuda_rng) = stash.pop()
                    needs = x.is_floating_point() and (index > 1 or self.previous is not None)
                    x = x.detach().requires_grad_(needs)
                    with torch.enable_grad(), torch.random.fork_rng(devices), observers.compute("stage_backward"):
                        torch.set_rng_state(cpu_rng)
                        for device, state in zip(devices, cuda_rng):
                            torch.cuda.set_rng_state(state, device)
                        out = self.layers[index - 1](x, side)
                        if last and index == len(self.layers):
                            out = self.loss(out, micro_batch, side, total)
                        out.backward(upstream)
                    upstream = x.grad if needs else None
                    if not (index == 1 and after is Pass.FORWARD):
                        units[index].free()
                    if per_micro_batch:
                        sharded.reduce_unit(units[index])
                if self.previous is not None:
                    self.transfers.send(upstream if upstream is not None else torch.zeros_like(x), self.previous,
                                        Pass.BACKWARD, k)
            self.transfers.flush()
            if train:
                for unit in reversed(units if not per_micro_batch else units[:1]):  # [Note: collective order]
                    sharded.reduce_unit(unit)
                sharded.wait_reductions()
            sharded.free_all()
        return loss_sum

    def _forward(self, received: torch.Tensor | None, micro_batch: Any, total: float) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            first_input, side = self.prepare(micro_batch)
        x = first_input if received is None else received.requires_grad_(torch.is_grad_enabled())
        h = x
        for layer in self.layers:
            h = layer(h, side)
        if self.next is None:
            h = self.loss(h, micro_batch, side, total)
        return x, h

    # ------------------------------------------------------------------ tied parameters, clipping

    def _piece(self, name: str) -> tuple[nn.Parameter, int, int, int]:
        for unit in self.sharded.units:
            for index, span in enumerate(unit.spans):
                if span.name == name:
                    a, b = unit.local_range(index)
                    return unit.local_params[index], a, b, span.numel
        raise KeyError(name)

    @torch.no_grad()
    def _sum_ties(self) -> None:
        """[Note: parameters tied across stages] Each holding stage reduced its own gradient onto its
        pieces; one all-reduce over the holders' ranks of the pieces written into a zero full-size
        buffer gives every holder the sum over the stages, the same bits on each (x + 0 is exact)."""
        for tie in self.ties:
            piece, a, b, numel = self._piece(tie.name)
            full = torch.zeros(numel, dtype=piece.dtype, device=self.device)
            if piece.grad is not None:
                full[a:b] = piece.grad.reshape(-1)
            dist.all_reduce(full, group=tie.group)
            if b > a:
                piece.grad = full[a:b].view(piece.shape).clone()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every piece's gradient so the whole model's gradient has norm at most ``max_norm``:
        the norm over every stage's pieces, a tied parameter counted once (by its first stage)."""
        skip = {tie.name for tie in self.ties if not tie.counted}
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, param in self.sharded.named_parameters():
            if param.grad is not None and name not in skip:
                local += param.grad.double().pow(2).sum()
        dist.all_reduce(local)
        norm = local.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in self.sharded.parameters():
            if param.grad is not None:
                param.grad.mul_(coef.to(param.grad.dtype))
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over the stage: this stage's parameters, whole, under their names in the model."""
        return self.sharded.full_state_dict()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over every rank: the whole model's parameters, each once under its name in
        ``model.named_parameters()`` (a tied one under its first name) and its shape, on every rank;
        what a non-pipelined run of the same model holds (a consolidated checkpoint, an export)."""
        stage = {self.canonical[name]: value for name, value in self.full_state_dict().items()}
        first = self.rank == self.layout.stage_ranks(self.stage)[0]
        out: dict[str, torch.Tensor] = {}
        for part in gather_objects(stage if first else {}):
            out.update(part)
        return out

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's pieces of its stage set from a whole model's parameters (``model_state_dict``'s
        names: a non-pipelined run's); every parameter of the stage must be there, with its shape."""
        for unit in self.sharded.units:
            for index, span in enumerate(unit.spans):
                name = self.canonical[span.name]
                whole = state.get(name)
                if whole is None or tuple(whole.shape) != tuple(span.shape):
                    got = "missing" if whole is None else f"of shape {tuple(whole.shape)}"
                    raise ValueError(f"the state's {name} is {got}; stage {self.stage} needs {tuple(span.shape)}: load a "
                                     "state of the same model")
                a, b = unit.local_range(index)
                piece = unit.local_params[index]
                piece.copy_(whole.reshape(-1)[a:b].view(piece.shape).to(piece.dtype))


def _free_other_stages(layers: Sequence[Layer], view: nn.Module) -> None:
    """[Note: a rank holds its own stage only] Every parameter of another stage's layers becomes a meta
    tensor of its shape (no storage; a use fails loudly), except the first layer's: a later stage's
    ``prepare`` runs the model's input path for the side inputs (masks, position ids, rotary tables),
    which the layered protocol lets use the first layer's modules. Those keep the values they were
    built with and are never trained there: side inputs must not depend on the first layer's
    parameter values (Hugging Face's do not; the hidden state ``prepare`` computes on a later stage is
    discarded for the one received)."""
    mine = {id(p) for p in view.parameters()}
    for layer in layers[1:]:
        for module in layer.modules:
            for name, param in list(module.named_parameters(recurse=True)):
                if id(param) in mine or param.is_meta:
                    continue
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                holder._parameters[leaf] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                        requires_grad=param.requires_grad)
