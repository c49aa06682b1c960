"""Cluster files from the Cephalo release's profiles, so its users can re-plan their measurements here.

The release writes two files (as its optimizer reads them):

* ``model_latencies.json``: ``{model: {gpu: {seq_len: {dtype: runtime}}}}``, one layer's times in
  ms, where ``runtime`` is a number (a forward slope per sample), ``[[fwd_slope, fwd_intercept]]``,
  ``[[fwd_slope, fwd_intercept], [bwd_slope, bwd_intercept]]``, or that plus the measured
  ``[fwd_ms at 1..k]`` and ``[bwd_ms at 1..k]`` arrays. Its backward excludes the recomputed
  forward, as this planner's ``layer_bwd_ms`` does.
* ``model_memory.json``: ``{cluster: {model: {"parameters": P, "profiled_compute_memory":
  {dtype: [GiB at micro-batch 1..k]}, ...}}}``: compute memory per micro-batch size, one series
  for every GPU of the cluster.

Conversion (each series keeps its own length; see docs/cluster.md):

* times: measured arrays where given; where the release would extrapolate with its line fit, the
  fit's values at the next two sizes are appended, so this planner's extrapolation (through the
  last two points) follows the same line. Fits alone give the line at sizes 1 and 2. A forward
  without a backward (the number and one-pair forms) gets ``B = 2 F``, the catalog's convention.
* memory: the measured series plus one point at the release's growth rate (the mean step over the
  last up to five points), which this planner then extrapolates linearly, as the release does.
* capacity: the GPU catalog's (``--memory-gb NAME=GB`` overrides or adds one); the release's
  ``max_alloc_frac`` 0.75, 2 GB ``comm_mem_overhead`` and 10 ms per extra micro-batch are the
  settings' defaults already; 16 bytes of state per parameter, as the release charges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cephalo_lightning._common.vocabulary import ProfileSource
from cephalo_lightning.planner.schema.catalog import lookup
from cephalo_lightning.planner.schema.cluster import cluster_from_dict
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.files import read_document
from cephalo_lightning.planner.schema.planning_error import PlanningError

MIN_MS = 1e-5  # a line fit may cross zero at small sizes; the planner needs positive times
RELEASE_GROWTH_POINTS = 5  # the release averages the memory growth over the last five points


RELEASE_FILE = "give the Cephalo release's unedited file (or fix the entry by hand)"


def _read_json(path: str | Path, what: str) -> Any:
    return read_document(path, f"release {what}", f"give the Cephalo release's {what} file", json_only=True)


def _pick(data: Any, key: str | None, what: str, where: str) -> Any:
    """``data[key]``, or its only entry when no key is given; clear errors otherwise."""
    if not isinstance(data, Mapping) or not data:
        raise PlanningError(f"{where}: expected an object keyed by {what}, got {type(data).__name__}; is it the "
                            f"release's file?")
    if key is None:
        if len(data) != 1:
            raise PlanningError(f"{where} has several {what}s {sorted(map(str, data))}; choose one with --{what.replace(' ', '-')}")
        return next(iter(data.values()))
    if str(key) not in data:
        raise PlanningError(f"{where} has no {what} {key!r}; it has {sorted(map(str, data))}: choose one of those")
    return data[str(key)]


def _numbers(value: Any, where: str) -> list[float]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise PlanningError(f"{where} must be a list of numbers, got {value!r}; {RELEASE_FILE}")
    return [float(v) for v in value]


def _line(pair: Any, where: str) -> tuple[float, float]:
    values = _numbers(pair, where)
    if len(values) != 2:
        raise PlanningError(f"{where} must be a [slope, intercept] pair, got {pair!r}; {RELEASE_FILE}")
    return values[0], values[1]


def latency_series(runtime: Any, where: str) -> tuple[list[float], list[float]]:
    """(layer_fwd_ms, layer_bwd_ms) from one entry of model_latencies.json (see module docstring)."""
    if isinstance(runtime, (int, float)) and not isinstance(runtime, bool):
        fwd_fit, bwd_fit = (float(runtime), 0.0), None
        arrays: tuple[list[float], list[float]] | None = None
    elif isinstance(runtime, Sequence) and not isinstance(runtime, str) and len(runtime) in (1, 2, 4):
        fwd_fit = _line(runtime[0], f"{where}[0]")
        bwd_fit = _line(runtime[1], f"{where}[1]") if len(runtime) >= 2 else None
        arrays = (_numbers(runtime[2], f"{where}[2]"), _numbers(runtime[3], f"{where}[3]")) if len(runtime) == 4 else None
    else:
        raise PlanningError(f"{where}: a runtime is a number, [[slope, intercept]], [[fwd], [bwd]] fits, or the "
                            f"fits plus [fwd_ms], [bwd_ms] arrays; got {runtime!r}; {RELEASE_FILE}")

    def fit(line: tuple[float, float], m: int) -> float:
        return max(MIN_MS, line[0] * m + line[1])

    def extend(measured: list[float], line: tuple[float, float]) -> list[float]:
        k = len(measured)
        return [max(MIN_MS, v) for v in measured] + [fit(line, k + 1), fit(line, k + 2)]

    if arrays is not None and arrays[0] and arrays[1]:
        fwd = extend(arrays[0], fwd_fit)
        bwd = extend(arrays[1], bwd_fit) if bwd_fit is not None else [2 * v for v in fwd]
        return fwd, bwd
    fwd = [fit(fwd_fit, m) for m in (1, 2)]
    bwd = [fit(bwd_fit, m) for m in (1, 2)] if bwd_fit is not None and (bwd_fit[0] or bwd_fit[1]) else \
        [2 * v for v in fwd]
    return fwd, bwd


def memory_series(measured: list[float]) -> list[float]:
    """The release's compute memory with one more point at its extrapolation's growth rate."""
    k = len(measured)
    if k < 2:
        return measured
    span = min(RELEASE_GROWTH_POINTS, k)
    growth = (measured[-1] - measured[-span]) / (span - 1)
    return measured + [measured[-1] + growth]


def parse_gpus(spec: str) -> list[tuple[str, int]]:
    """``"l4:2,a6000,p40"`` -> [("l4", 2), ("a6000", 1), ("p40", 1)] (rank order)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, count = part.partition(":")
        if count and (not count.isdigit() or int(count) < 1):
            raise PlanningError(f"--gpus: {part!r}: the count after ':' must be a whole number >= 1")
        out.append((name.strip(), int(count) if count else 1))
    if not out:
        raise PlanningError("--gpus needs at least one GPU, e.g. --gpus l4:2,a6000,p40")
    return out


def convert_release(
    latencies: str | Path | Mapping[str, Any],
    memory: str | Path | Mapping[str, Any],
    *,
    model: str,
    num_layers: int,
    gpus: Sequence[tuple[str, int]],
    seq_len: int | str | None = None,
    dtype: str | None = None,
    cluster: str | None = None,
    memory_gb: Mapping[str, float] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The cluster file (as a dict) for ``gpus`` (rank order, with counts) from the release's two files."""
    lat = latencies if isinstance(latencies, Mapping) else _read_json(latencies, "model_latencies.json")
    mem = memory if isinstance(memory, Mapping) else _read_json(memory, "model_memory.json")
    per_model = _pick(mem, cluster, "cluster", "model_memory.json")
    spec = _pick(per_model, model, "model", "model_memory.json[cluster]")
    if not isinstance(spec, Mapping) or "parameters" not in spec or "profiled_compute_memory" not in spec:
        raise PlanningError(f"model_memory.json[...][{model!r}] needs 'parameters' and 'profiled_compute_memory'; "
                            f"{RELEASE_FILE}")
    compute = _numbers(_pick(spec["profiled_compute_memory"], dtype, "dtype",
                             f"model_memory.json[...][{model!r}].profiled_compute_memory"),
                       f"profiled_compute_memory[{dtype}]")
    gpu_table = _pick(lat, model, "model", "model_latencies.json")
    devices = []
    for name, count in gpus:
        where = f"model_latencies.json[{model!r}][{name!r}]"
        per_seq = _pick(gpu_table, name, "gpu", f"model_latencies.json[{model!r}]")
        runtime = _pick(_pick(per_seq, None if seq_len is None else str(seq_len), "seq len", where), dtype,
                        "dtype", f"{where}[seq]")
        fwd, bwd = latency_series(runtime, where)
        capacity = (memory_gb or {}).get(name)
        if capacity is None:
            known = lookup(name)
            if known is None:
                raise PlanningError(f"GPU {name!r} is not in the catalog, so its memory is unknown; give it with "
                                    f"--memory-gb {name}=GB")
            capacity = known.memory_gb
        devices.append({"name": name, "count": count, "memory_gb": float(capacity), "layer_fwd_ms": fwd,
                        "layer_bwd_ms": bwd, "compute_memory_gb": memory_series(compute), "source": ProfileSource.MEASURED})
    parameters = spec["parameters"]
    if isinstance(parameters, bool) or not isinstance(parameters, (int, float)) or parameters < 1:
        raise PlanningError(f"model_memory.json[...][{model!r}].parameters must be a positive number, got "
                            f"{parameters!r}; {RELEASE_FILE}")
    model_entry: dict[str, Any] = {"name": model, "num_layers": num_layers, "parameters": int(parameters),
                                   "state_bytes_per_param": 16}
    if seq_len is not None:
        model_entry["seq_len"] = int(seq_len)
    return {"model": model_entry, "settings": dict(settings or {}), "devices": devices}


def release_cluster(*args: Any, **kwargs: Any) -> Cluster:
    """:func:`convert_release`, parsed and validated into a :class:`Cluster`."""
    return cluster_from_dict(convert_release(*args, **kwargs))
