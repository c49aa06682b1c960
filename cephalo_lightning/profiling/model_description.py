"""The cost model's :class:`~cephalo_lightning.planner.ModelSpec` from what the caller says and what was measured.

    spec = description.spec(profile, compute_bytes_per_param)

The caller knows what the layers cannot tell: the model's name, its whole parameter count (a
sharded model's layers hold shards), how many of them train, the bytes of the training state per
trainable and per frozen parameter, the hidden size and the sequence length. The profile supplies
the rest: the layer count, the parameters when the caller gave none, what the layered schedule
stashes and keeps per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from cephalo_lightning.planner import ModelSpec
from cephalo_lightning.profiling.model import ModelProfile


@dataclass(frozen=True)
class ModelDescription:
    """What the caller says of the profiled model (every field optional).

    ``parameters`` defaults to the layers' parameters and ``trainable_parameters`` to their trainable
    ones; a frozen parameter is priced at ``weight_bytes_per_param``, a trainable one at
    ``state_bytes_per_param``.
    """

    name: str = "model"
    parameters: int | None = None
    trainable_parameters: int | None = None
    state_bytes_per_param: float = 16.0
    weight_bytes_per_param: float = 4.0
    hidden_size: int | None = None
    seq_len: int | None = None

    def cache_key(self) -> list[object]:
        """The description's part of the cache fingerprint (its order is that of existing cache files)."""
        return [self.name, self.parameters, float(self.state_bytes_per_param), self.hidden_size, self.seq_len,
                self.trainable_parameters, float(self.weight_bytes_per_param)]

    def spec(self, profile: ModelProfile, compute_bytes_per_param: float) -> ModelSpec:
        """The planner's model: this description completed by the measured ``profile``."""
        trainable = self.trainable_parameters
        if trainable is None and self.parameters is None:  # the layers' own count: their own trainable ones
            trainable = profile.parameters
        stashes = profile.input_bytes_per_sample
        return ModelSpec(
            name=self.name,
            num_layers=profile.num_layers,
            parameters=self.parameters if self.parameters is not None else sum(profile.layer_numels),
            trainable_parameters=trainable,
            state_bytes_per_param=float(self.state_bytes_per_param),
            weight_bytes_per_param=float(self.weight_bytes_per_param),
            hidden_size=self.hidden_size,
            seq_len=self.seq_len,
            compute_bytes_per_param=compute_bytes_per_param,
            # measured: what the layered schedule stashes per sample (mean over the layers' inputs) and
            # keeps on the device between its passes when the stash is not offloaded
            stash_bytes_per_sample=sum(stashes) / len(stashes) if stashes else None,
            kept_bytes_per_sample=profile.kept_bytes_per_sample if stashes else None,
            largest_unit_parameters=max(profile.layer_numels) if profile.layer_numels else None,
            largest_reduced_parameters=max(profile.layer_trainable_numels) if profile.layer_trainable_numels else None,
        )
