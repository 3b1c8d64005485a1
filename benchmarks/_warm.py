"""Imported once by the benchmarks' fork server, as Piper's fork launcher preloads its own: pays
torch's lazy start-up costs (distributed, fx, the meta-device kernels behind initialising a
model on ``meta``) and imports Piper before any rank is forked."""
import torch
import torch.distributed  # noqa: F401
import torch.fx  # noqa: F401

import piper_plugin  # noqa: F401

with torch.device("meta"):
    torch.nn.Embedding(2, 2)
    torch.nn.Linear(2, 2)(torch.empty(1, 2))
