"""Autograd mechanics shared by capture (the size probe) and the runtime.

The bottom layer: it imports nothing of Piper. ``split_backward`` computes a chunk's input
gradients before its weight gradients (BI then BW) from one saved forward; ``working_memory``
counts the storage an autograd backward allocates while it runs; ``deferred_weights`` lets a
custom Function hand its weight-gradient work from BI to BW.
"""
from piper_plugin.autograd.deferred_weights import DeferredWeightGrads, deferred_weight_grads, will_execute
from piper_plugin.autograd.split_backward import PendingWeightGrads, backward_input
from piper_plugin.autograd.working_memory import WorkingMemory

__all__ = ["backward_input", "DeferredWeightGrads", "deferred_weight_grads", "PendingWeightGrads", "will_execute",
           "WorkingMemory"]
