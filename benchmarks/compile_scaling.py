"""Compile time vs DAG size: capture + passes + plan + simulate of interleaved 1F1B on the toy LM.

Each size runs in a fresh process, as a user's first compile does, timing the phases of

    model on meta (pp*v stages, one layer each) -> capture -> Schedule + interleaved-1f1b
    (place, replicate, split, order) -> build_plan -> simulate

``build`` is the model's construction; on meta it includes torch's one-time import of
torch._dynamo (the first meta op that runs a Python decomposition pulls it in). ``total``
covers every phase, build included (the acceptance figure: pp=32, v=2, m=128 under 5 s);
``us/node`` divides the four compile phases by the nodes of the scheduled DAG and ``DAG
us/node`` the three after capture (capture grows with layers, not nodes): a flat column
means linear growth. Each size keeps its fastest of ``--repeat`` runs.

    python -m benchmarks.compile_scaling
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("build", "capture", "passes", "plan", "simulate")


def one(pp: int, v: int, m: int, dp: int = 1, recipe: str = "interleaved-1f1b") -> dict:
    """Compile one size in this process (``dp`` data-parallel replicas, one sample per
    microbatch each); phase seconds, nodes and edges."""
    import torch
    from piper_plugin import Schedule, build_plan, capture, simulate
    from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
    from piper_plugin.recipes import apply_recipe
    t = [time.perf_counter()]  # imports are not compile time (the acceptance script imports first)
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=pp * v, layers=pp * v)
    x, y = lm_batch(cfg, m * dp)
    t.append(time.perf_counter())
    program = capture(model, lm_loss, (x,), y)
    t.append(time.perf_counter())

    sch = Schedule(program, pp=pp, dp=dp)
    apply_recipe(sch, recipe, microbatches=m, chunks=v)
    t.append(time.perf_counter())
    plan = build_plan(sch.dag, sch.grid)  # the steps piper.compile_program runs, timed one by one
    t.append(time.perf_counter())
    simulate(plan)
    t.append(time.perf_counter())
    return {"nodes": len(plan.dag), "edges": plan.dag.num_edges(),
            **{p: b - a for p, a, b in zip(PHASES, t, t[1:])}}


def measure(pp: int, v: int, m: int, dp: int, recipe: str, repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", str(pp), str(v), str(m),
                              str(dp), recipe],
                             check=True, capture_output=True, text=True, cwd=ROOT)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return min(runs, key=lambda r: sum(r[p] for p in PHASES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["4x16", "8x32", "16x64", "32x128", "32x256"],
                    help="PPxMICROBATCHES[xDP] per row")
    ap.add_argument("--recipe", default="interleaved-1f1b", help="the recipe compiled (default: interleaved-1f1b)")
    ap.add_argument("--chunks", type=int, default=2, help="v: stages per pipeline rank")
    ap.add_argument("--repeat", type=int, default=3, help="fresh-process runs per size; the fastest is kept")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_scaling.md"))
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*map(int, args.one[:4]), args.one[4])))
        return
    command = (f"python -m benchmarks.compile_scaling --sizes {' '.join(args.sizes)} --recipe {args.recipe} "
               f"--chunks {args.chunks} --repeat {args.repeat}"
               + ("" if args.out == ap.get_default("out") else f" --out {os.path.relpath(args.out, ROOT)}"))
    print(command)
    head = ("| pp | dp | ranks | v | m | nodes | edges | " + " | ".join(f"{p} s" for p in PHASES)
            + " | total s | compile s | us/node | DAG us/node |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    print(head)
    rows = []
    for size in args.sizes:
        pp, m, *rest = map(int, size.lower().split("x"))
        dp = rest[0] if rest else 1
        r = measure(pp, args.chunks, m, dp, args.recipe, args.repeat)
        dag_s = r["passes"] + r["plan"] + r["simulate"]
        compile_s = r["capture"] + dag_s
        row = (f"| {pp} | {dp} | {pp * dp} | {args.chunks} | {m} | {r['nodes']} | {r['edges']} | "
               + " | ".join(f"{r[p]:.2f}" for p in PHASES)
               + f" | {compile_s + r['build']:.2f} | {compile_s:.2f} | {1e6 * compile_s / r['nodes']:.1f}"
               + f" | {1e6 * dag_s / r['nodes']:.1f} |")
        lines.append(row)
        rows.append(r)
        print(row, flush=True)
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "piper_plugin"], capture_output=True, text=True, cwd=ROOT).stdout
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = "\n".join([
        f"# Compile time vs DAG size ({args.recipe}, toy LM on meta)", "",
        f"Command: `{command}`", "",
        f"Machine: torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores "
        f"({platform.machine()}), load average {load} when the run ended; code at {commit}"
        f"{' with uncommitted engine changes' if dirty else ''}.", "",
        "Each row: the fastest of the fresh-process runs. `build`: the model on meta, including torch's "
        "one-time import of torch._dynamo; `total`: every phase; `compile`: capture + passes + plan + "
        "simulate; `us/node`: compile / nodes of the scheduled DAG; `DAG us/node`: (passes + plan + "
        "simulate) / nodes (flat = linear growth).", "",
        *lines, "", f"Growth curve: [{Path(args.out).stem}.png]({Path(args.out).stem}.png)", ""])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    _plot(rows, Path(args.out).with_suffix(".png"), args.recipe)
    print(f"wrote {args.out}")


def _plot(rows: list[dict], path: Path, recipe: str) -> None:
    """Seconds per phase against the scheduled DAG's nodes, log-log (slope 1: linear growth)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    nodes = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for phase in ("capture", "passes", "plan", "simulate"):
        ax.plot(nodes, [r[phase] for r in rows], marker="o", label=phase)
    ax.plot(nodes, [sum(r[p] for p in PHASES) for r in rows], marker="s", color="black", label="total")
    ax.set(xscale="log", yscale="log", xlabel="nodes of the scheduled DAG", ylabel="seconds",
           title=f"Compile time vs DAG size ({recipe})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
