"""A machine's ranks over an emulated network link: re-run a command in a private network
namespace (``unshare -n``, root) whose loopback is limited by a ``tc ... tbf`` qdisc, so every
message between the ranks costs wire time at that rate instead of only CPU.

The bucket is 32 KiB with the loopback's MTU at 9000 bytes (tbf never sends a packet larger than
its bucket; gloo's connections stalled on the default 64 KiB MTU) and the queue holds up to 2 s
of traffic, so nothing is dropped. Every rank, the rendezvous and every collective share that one
link. Invariant: inside, :func:`inside_link` names the rate; a command re-run that way never
enters a second namespace.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["run_in_emulated_link", "inside_link", "link_bits_per_second", "python_module_argv"]

_INSIDE = "PIPER_EMULATED_LINK"


def link_bits_per_second(rate: str) -> float:
    """``rate`` as tc writes it (``100mbit``, ``1gbit``, ``500kbit``) in bits per second; a
    ValueError names the form otherwise."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            try:
                value = float(rate[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * scale
    raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")


def inside_link() -> str | None:
    """The emulated link's rate when this process runs inside one, else None."""
    return os.environ.get(_INSIDE) or None


def run_in_emulated_link(rate: str, argv: Sequence[str], cwd: str | Path | None = None) -> int:
    """Run ``argv`` (a command line) in a new network namespace whose loopback is ``rate``; its
    exit status. Needs root, ``unshare`` and ``tc`` (iproute2): without them a RuntimeError says so."""
    link_bits_per_second(rate)
    missing = [tool for tool in ("unshare", "tc", "ip") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        raise RuntimeError(f"an emulated link needs root and {', '.join(missing) or 'unshare, tc and ip'} "
                           f"(iproute2, util-linux); run as root on Linux")
    setup = (f"ip link set lo mtu 9000 && ip link set lo up && "
             f"tc qdisc add dev lo root tbf rate {rate} burst 32kb latency 2s")
    inner = " ".join(map(shlex.quote, argv))
    env = dict(os.environ, **{_INSIDE: rate})
    return subprocess.run(["unshare", "-n", "bash", "-c", f"{setup} && exec {inner}"], env=env,
                          cwd=cwd).returncode


def python_module_argv(module: str, args: Sequence[str]) -> list[str]:
    """``python -m module args`` with this interpreter (what to run inside the link)."""
    return [sys.executable, "-m", module, *args]
