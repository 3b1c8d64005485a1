"""FSDP2-wrapped stages under a Piper step: reduce gradients once per step, not per backward.

TorchTitan wraps every model part with ``fully_shard`` (a no-op all-gather at degree 1, HSDP with
``data_parallel_replicate_degree`` > 1). While a step's plan runs, :func:`hold_gradients` keeps
the parameters unsharded and their gradients unsharded and unreduced, so a split backward's BW
can run autograd to the unsharded weights after BI already passed the module's inputs (where
FSDP's post-backward hook fires). After a stage's last backward task :func:`reduce_gradients`
runs each of its parameter groups' post-backward once: gradients are reduced (all-reduced over
replicas) into the sharded ``param.grad`` that TorchTitan clips and steps, and the parameters
are resharded. This is what torch.distributed.pipelining does after a stage's last backward.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["fsdp_roots", "hold_gradients", "reduce_gradients"]


def fsdp_roots(parts: dict[int, nn.Module]) -> list[FSDPModule]:
    """The outermost FSDP modules of the parts (their settings recurse to the inner ones)."""
    roots = []
    for part in parts.values():
        inner = {id(m) for root in part.modules() if isinstance(root, FSDPModule)
                 for m in root.modules() if m is not root}
        roots += [m for m in part.modules() if isinstance(m, FSDPModule) and id(m) not in inner]
    return roots


def hold_gradients(roots: list[FSDPModule]) -> None:
    for module in roots:
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def reduce_gradients(roots: list[FSDPModule]) -> None:
    for module in roots:
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)
        for inner in state._state_ctx.all_states:
            for group in inner._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
