"""Compute handlers, one per chunk kind; each reads its inbox and delivers its outputs.

Invariants: F makes every input produced by another region a fresh autograd leaf, so B / BI
yield exactly the gradients to send upstream (a chunk that is one piece of a paused forward,
:mod:`.paused_forward`, runs its piece and that piece's backward instead of a whole call); BI keeps the graph and the gradients reaching
its weight side for BW (:mod:`.split_backward`), so BW runs only weight-gradient kernels; the
loss output's gradient is the microbatch scale 1/(microbatches x data shards), so summed over all of them
the step equals the full-batch mean.
"""
from __future__ import annotations

import torch

from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.runtime.rank_state import RankState
from piper_plugin.autograd.split_backward import backward_input, weight_pass_repeats_work
from piper_plugin.runtime.streams import Continue

__all__ = ["run_compute"]


def _forward(state: RankState, node: Node) -> None:
    region = state.dag.regions[node.region]
    mb = node.microbatch
    box = state.take(node.key)
    args, leaves = [], {}
    for v in region.inputs:
        if v in box:
            t = box[v]
            leaf = t.detach().requires_grad_(t.is_floating_point())
            leaves[v] = leaf
            args.append(leaf)
        elif v in state.inputs:
            args.append(state.inputs[v][mb])
        else:
            raise RuntimeError(f"rank {state.rank}: {node.key} did not receive input {v!r}")
    chunk = state.chunks[node.region]
    with state.meter.window(node.key, saves=True), state.block_task(node.region, "F"), state.forward_context():
        piece = getattr(chunk, "forward_piece", None)  # a piece of a paused forward (hand-offs)
        outputs = dict(zip(region.outputs, piece(mb, args) if piece is not None else chunk(*args)))
    state.saved[(node.region, mb)] = (leaves, outputs)
    if node.region == state.loss_region:
        state.losses.append(outputs[state.loss_value].detach() * state.scale)
        if state.update_gate is not None:
            state.update_gate.loss(state.losses[-1])
    state.deliver(node.key, {k: t.detach() for k, t in outputs.items()})


def _output_grads(state: RankState, node: Node, outputs, box):
    outs, grads = [], []
    for v, t in outputs.items():
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            continue
        if v == state.loss_value and node.region == state.loss_region:
            g = torch.full_like(t, state.scale)
        else:
            g = box.get(f"grad:{v}")
        if g is not None:
            outs.append(t)
            grads.append(g)
    return outs, grads


def _deliver_input_grads(state: RankState, node: Node, leaves, grads) -> None:
    out = {f"grad:{v}": g for (v, _), g in zip(leaves.items(), grads) if g is not None}
    state.deliver(node.key, out)


def _backward(state: RankState, node: Node) -> None:
    with state.meter.window(node.key):  # the graph, and what it saved, goes inside
        leaves, outputs = state.saved.pop((node.region, node.microbatch))
        outs, grads = _output_grads(state, node, outputs, state.take(node.key))
        piece = getattr(state.chunks[node.region], "backward_piece", None)
        with state.block_task(node.region, "B"):
            if piece is not None:  # runs even without gradients: it also frees the piece
                piece(node.microbatch, outs, grads)
            elif outs:
                torch.autograd.backward(outs, grads)
        del outputs, outs, grads
    _deliver_input_grads(state, node, leaves, [leaf.grad for leaf in leaves.values()])


def _backward_input(state: RankState, node: Node) -> None:
    # its BW comes right after on this stream, a piece of a paused forward (no split of its
    # own), or a graph whose BW would repeat BI's work (BI costs a full pass anyway): one pass,
    # its BW has nothing left to do
    if (node.key in state.fused_backward or hasattr(state.chunks[node.region], "backward_piece")
            or not _split_pays(state, node)):
        _backward(state, node)
        return
    key = (node.region, node.microbatch)
    with state.meter.window(node.key):
        leaves, outputs = state.saved[key]
        outs, grads = _output_grads(state, node, outputs, state.take(node.key))
        wanted = [leaf for leaf in leaves.values() if leaf.requires_grad]
        with state.block_task(node.region, "BI"):
            got, pending = backward_input(outs, grads, wanted)
        del outputs, outs, grads
        if state.dag.regions[node.region].params:
            state.pending_bw[key] = pending
        else:
            del state.saved[key], pending
    if key in state.pending_bw:  # counted from here until BW has run
        state.meter.add(state.pending_bw[key].recorded_bytes)
        state.meter.kept_for_weights[node.key] = state.pending_bw[key].recorded_bytes
    got = iter(got)
    _deliver_input_grads(state, node, leaves, [next(got) if leaf.requires_grad else None for leaf in leaves.values()])


def _weight_grads(state: RankState, node: Node) -> None:
    """Run the weight-gradient pass its BI left pending (none: BI ran as one full backward)."""
    key = (node.region, node.microbatch)
    if key not in state.pending_bw:
        return
    pending = state.pending_bw.pop(key)
    with state.meter.window(node.key), state.block_task(node.region, "BW"):
        pending.run()
        del state.saved[key]
    state.meter.add(-pending.recorded_bytes)


def _backward_weight(state: RankState, node: Node) -> None:
    state.take(node.key)  # BI already read these gradients; drop BW's copies
    _weight_grads(state, node)


def _update(state: RankState, node: Node) -> None:
    if state.snapshot_grads:
        state.snapshot(node.region)
    optimizer = state.optimizers[node.region]
    if state.update_gate is None or state.update_gate.allows():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if getattr(optimizer, "host_steps", False):
        return  # the host reads the shards' gradients after the step (HostFaces) and steps itself
    for (region, _), bucket in state.buckets.items():
        if region == node.region:
            bucket.step_done()


_HANDLERS = {Kind.F: _forward, Kind.B: _backward, Kind.BI: _backward_input, Kind.BW: _backward_weight,
             Kind.UPDATE: _update}


def _hand_off_grads(state: RankState, node: Node) -> None:
    """Per-microbatch reductions (ZeRO-2/3) get this microbatch's gradients by value, so a
    reduce-scatter on another stream never races the next microbatch's backward."""
    for succ, bucket in state.grad_handoffs(node.key):
        state.deliver_to(succ, "grads", state.buckets[(node.region, bucket)].flat_grad(take=True))
        state.gradients_handed_over((node.region, bucket))


def _split_pays(state: RankState, node: Node) -> bool:
    """Whether B's graph splits without repeating work (:func:`weight_pass_repeats_work`):
    decided on the region's first backward (which nodes sit on the frontier is the region's code)."""
    pays = state.split_pays.get(node.region)
    if pays is None:
        leaves, outputs = state.saved[(node.region, node.microbatch)]
        outs = [t for t in outputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        wanted = [leaf for leaf in leaves.values() if leaf.requires_grad]
        pays = state.split_pays[node.region] = not weight_pass_repeats_work(outs, wanted)
    return pays


def run_compute(state: RankState, node: Node) -> Continue | None:
    """Run ``node``. A B in ``state.input_grads_first`` runs its input-gradient pass, delivers
    those gradients and returns the weight-gradient pass as a :class:`Continue`: the runner
    posts the sends upstream before the rest runs (same gradients as one full backward). Where
    a split would repeat work (custom autograd Functions on the weight side, e.g. Megatron's
    linear layers) that B runs as one pass, and a BI too (its BW then has nothing to do)."""
    if node.key in state.input_grads_first and _split_pays(state, node):
        _backward_input(state, node)

        def rest() -> None:
            _weight_grads(state, node)
            _hand_off_grads(state, node)
            state.finished(node.key)
        return Continue(rest)
    _HANDLERS[node.kind](state, node)
    if node.kind in (Kind.B, Kind.BW):
        _hand_off_grads(state, node)
    state.finished(node.key)
    return None
