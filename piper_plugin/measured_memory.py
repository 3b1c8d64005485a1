"""Region memory measured by a host's traced steps, in place of what the program estimated.

A host's program knows its regions' memory only as well as the host lets Piper look: TorchTitan's
stages are probed on fake tensors, Megatron's are estimated from their parameters. The runtime's
memory meter measures it as the steps run (``--piper.trace`` / ``--piper-trace`` record it:
:class:`~piper_plugin.StepTrace`). Per region and per what the simulator charges:

- ``saved``: what a forward keeps for its backward (its windows' change of saved bytes);
- ``shared``: what a forward of the region saves on top when no other microbatch's activations
  of it are alive, once for all of them (a cache they share; ``Region.shared_activation_bytes``);
- ``full``: a whole backward's rise above its start (B, or a BI that ran the whole backward);
- ``inputs`` / ``weights``: an input-gradient pass's and a weight pass's rise;
- ``kept``: what an input-gradient pass leaves for its weight pass.

A microbatch's value is fitted as ``batch part x scale + fixed part`` (``scale``: the microbatch's
share of the program's batch, ``1 / (microbatches x data shards)``; the fixed part is what does not
grow with the batch, such as parameter-sized gradients; activations have none, the shared part is
all fixed) by non-negative
least squares over every traced step (with one scale only: no fixed part). Invariant: a value
applies to the region of that name in a program of the stage count it was measured at, whose
batch is the one measured (a calibration's jobs keep the batch and vary the microbatches);
regions not measured keep the program's own figures.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Any

from piper_plugin.ir.graph import BackwardBytes, Rise
from piper_plugin.ir.nodes import Kind

__all__ = ["memory_samples", "fit_memory", "with_measured_memory", "stage_count"]


def stage_count(regions) -> int:
    """Distinct pipeline stages among ``regions`` (a program's or a DAG's): a profile's key."""
    return len({r.stage for r in regions.values()})


def memory_samples(plan, windows: dict[int, list], kept: dict[int, dict[str, int]]) -> list[tuple[str, str, float, int]]:
    """``(region, part, scale, bytes)`` from one traced step of ``plan``: per plan rank its meter
    windows ``(task, count, change, rise)`` and what its input-gradient tasks kept. A backward
    with two windows ran split around its sends (input gradients, then weight gradients): one
    sample of each pass. Other windows of one task add up: their changes in turn, the rise as the
    highest of each window's start plus its rise. Per rank and region: where its forwards' changes
    differ, ``saved`` is their median but the largest and ``shared`` what the largest adds (a
    forward that found the shared cache let go saved it anew); where they are alike (one forward,
    or none overlapping another's activations), each is ``single``: the two together. A
    backward part is the highest of the step (the peak a rank reaches in it)."""
    dag = plan.dag
    scale = 1.0 / (plan.microbatches * plan.grid.data_shards)
    samples: list[tuple[str, str, float, int]] = []
    for rank, entries in windows.items():
        per_task: dict[str, tuple[int, int]] = {}
        rises: dict[str, list[int]] = {}  # each window's own rise, in turn
        for task, _, change, rise in sorted(entries, key=lambda w: (w[0], w[1])):
            total, high = per_task.get(task, (0, 0))
            per_task[task] = (total + change, max(high, total + rise))
            rises.setdefault(task, []).append(rise)
        weight_passes = {(dag.nodes[t].region, dag.nodes[t].microbatch) for t in per_task
                         if t in dag.nodes and dag.nodes[t].kind == Kind.BW}
        forwards: dict[str, list[int]] = {}
        highest: dict[tuple[str, str], int] = {}
        for task, (change, rise) in per_task.items():
            node = dag.nodes.get(task)
            if node is None:
                continue
            shards = dag.meta.sharded.get(node.region, 1)  # an expert-sharded region holds 1/ep of it
            parts: list[tuple[str, int]] = []
            if node.kind == Kind.F:
                forwards.setdefault(node.region, []).append(change * shards)
            elif node.kind == Kind.B and len(rises[task]) == 2:  # input gradients, sends, weight gradients
                parts = [("inputs", rises[task][0]), ("kept", kept.get(rank, {}).get(task, 0)),
                         ("weights", rises[task][1])]
            elif node.kind == Kind.B or (node.kind == Kind.BI and (node.region, node.microbatch) not in weight_passes):
                parts = [("full", rise)]
            elif node.kind == Kind.BI:
                parts = [("inputs", rise), ("kept", kept.get(rank, {}).get(task, 0))]
            elif node.kind == Kind.BW:
                parts = [("weights", rise)]
            for part, nbytes in parts:
                slot = (node.region, part)
                highest[slot] = max(highest.get(slot, 0), nbytes * shards)
        for region, changes in forwards.items():
            rest = int(statistics.median(sorted(changes)[:-1])) if len(changes) > 1 else changes[0]
            if max(changes) == rest:  # each forward saved alike: the shared part, if any, each time
                samples += [(region, "single", scale, c) for c in changes]
            else:
                samples += [(region, "saved", scale, rest), (region, "shared", scale, max(changes) - rest)]
        samples += [(region, part, scale, nbytes) for (region, part), nbytes in highest.items()]
    return samples


def fit_memory(samples: list[tuple[str, str, float, int]]) -> dict[str, dict[str, list[int]]]:
    """Per region and part: ``[batch part, fixed part]`` (see the module docstring)."""
    import numpy as np
    from scipy.optimize import nnls

    grouped: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for region, part, scale, nbytes in samples:
        grouped.setdefault((region, part), []).append((scale, max(nbytes, 0)))
    fitted: dict[str, dict[str, list[int]]] = {}
    for region, part in [key for key in grouped if key[1] == "shared"]:  # all fixed: a median
        fitted.setdefault(region, {})["shared"] = [int(statistics.median(v for _, v in grouped.pop((region, part)))), 0]
    for region, part in [key for key in grouped if key[1] == "single"]:  # forwards that saved the shared part too
        shared = fitted.get(region, {}).get("shared", [0])[0]
        grouped.setdefault((region, "saved"), []).extend((s, v - shared) for s, v in grouped.pop((region, part)))
    for (region, part), points in sorted(grouped.items()):
        scales = np.array([s for s, _ in points])
        values = np.array([v for _, v in points], dtype=float)
        if part == "saved" or len(set(scales.tolist())) == 1:
            batch, fixed = float(np.median(values / scales)), 0.0
        else:
            rows = np.stack([scales / scales.max(), np.ones_like(scales)], axis=1)
            (batch, fixed), _ = nnls(rows, values)
            batch /= scales.max()
        fitted.setdefault(region, {})[part] = [int(round(batch)), int(round(fixed))]
    return fitted


def _region(region, measured: dict[str, list[int]]):
    def rise(part: str, old: Rise) -> Rise:
        return Rise.of(*measured[part]) if part in measured else old

    b = region.backward
    backward = BackwardBytes(full=rise("full", b.full), inputs=rise("inputs", b.inputs),
                             kept=rise("kept", b.kept), weights=rise("weights", b.weights))
    saved = measured["saved"][0] if "saved" in measured else region.activation_bytes
    shared = measured["shared"][0] if "shared" in measured else region.shared_activation_bytes
    return dataclasses.replace(region, activation_bytes=saved, backward=backward, shared_activation_bytes=shared)


def with_measured_memory(target, profile: dict[str, Any]):
    """``target`` (a plan or a program) with the memory ``profile["memory"]`` measured for its
    stage count in place of its regions' own; ``target`` itself where the profile measured none
    for it. The copy shares everything else with ``target``."""
    measured = profile.get("memory", {}).get(str(stage_count(target.dag.regions)), {})
    if not any(name in measured for name in target.dag.regions):
        return target
    regions = {name: _region(r, measured[name]) if name in measured else r for name, r in target.dag.regions.items()}
    out, dag = copy.copy(target), copy.copy(target.dag)
    dag.regions = regions
    out.dag = dag
    if hasattr(out, "regions"):  # a program keeps them beside its DAG
        out.regions = regions
    return out
