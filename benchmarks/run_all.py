"""Every benchmark of the project at a size that fits this machine, then ``docs/RESULTS.md``.

    python -m benchmarks.run_all                 # all of them, one after another
    python -m benchmarks.run_all --only projections compile_scaling

Each benchmark runs in its own process as ``python -m benchmarks.<name> <small sizes> --out
benchmarks/results/run_all/<name>.md`` (the sizes are :data:`BENCHES`', chosen so the whole run
takes under 20 minutes on 2 cores); its wall time and exit status are kept. One the machine cannot
run (``cuda_check`` without CUDA, ``ep_overlap`` without a private network namespace and ``tc``)
is listed with the reason. The report shows each benchmark's command, status and its results
file's tables, and three plots drawn from those tables: Piper against the host engines
(throughput ratios), memory (simulated against measured), and the simulator against measurement
(step times of ``piper calibrate``'s jobs, bubbles of ``ep_overlap``). The canonical, larger runs
stay in ``benchmarks/results/`` and ``docs/benchmarks.md``.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "run_all"
REPORT = ROOT / "docs" / "RESULTS.md"


@dataclass(frozen=True)
class Bench:
    name: str
    args: tuple[str, ...]
    needs: str | None = None  # "cuda", "netns" or "torchao": what the machine must have
    what: str = ""


BENCHES = (
    Bench("compile_scaling", ("--sizes", "8x32", "16x64x2", "64x1024x16", "--recipe", "1f1b", "--chunks", "1",
                              "--repeat", "1"), what="compile + schedule + simulate time up to 1,024 ranks"),
    Bench("projections", (), what="the paper's sweeps, simulated on an A100-like profile"),
    Bench("pipelining_ab", ("--schedules", "1f1b", "interleaved-1f1b", "--rounds", "2", "--warmup", "1", "--steps", "3",
                            "--quiet-wait", "0"), what="Piper vs torch.distributed.pipelining, step time"),
    Bench("task_overhead", ("--warmup", "2", "--steps", "6", "--quiet-wait", "0"),
          what="runtime overhead per task"),
    Bench("memory_check", ("--schedules", "1f1b", "zb-h1", "dualpipev", "--steps", "2"),
          what="simulated vs metered memory per rank"),
    Bench("torchtitan_ab", ("--schedules", "1F1B", "DualPipeV", "--rounds", "1", "--steps", "8", "--warmup", "2"),
          what="Piper vs TorchTitan's own engine, tokens/s"),
    Bench("compile_ab", ("--schedules", "1F1B", "--rounds", "1", "--steps", "8", "--warmup", "4"),
          what="torch.compile under both TorchTitan engines"),
    Bench("zero_memory", ("--models", "llama3_debugmodel", "--batches", "4", "8", "--steps", "2"),
          what="ZeRO under PP: peak memory and largest batch"),
    Bench("zero_parity", ("--models", "llama3", "--schedules", "1F1B", "--zero", "3", "--steps", "4"),
          what="ZeRO x PP parity with TorchTitan's engine"),
    Bench("ep_parity", ("--schedules", "1F1B", "--steps", "4"), what="expert parallelism parity with TorchTitan"),
    Bench("tp_parity", ("--models", "llama3", "--schedules", "1F1B", "--no-replicate", "--steps", "2"),
          what="tensor parallelism in TorchTitan's stages, parity with its engine"),
    Bench("megatron_ab", ("--schedules", "1f1b", "--layers", "4", "--hidden", "128", "--rounds", "1", "--warmup", "1",
                          "--steps", "3", "--quiet-wait", "0"), what="Piper vs Megatron-Core's schedules"),
    Bench("tune_ab", ("--rounds", "1", "--steps", "6"), what="piper tune's choice vs hand-written recipes"),
    Bench("host_predict", ("--hosts", "megatron", "--rounds", "1", "--steps", "6", "--calibrate-steps", "4",
                           "--schedules", "1f1b m=8", "dualpipev m=8 v=2 (untied embeddings)"),
          what="host cost profiles' predicted vs measured steps and memory"),
    Bench("ep_overlap", ("--rate", "1gbit", "--steps", "3", "--warmup", "1", "--cells", "piper:DualPipeV",
                         "piper:1F1B"), needs="netns", what="EP all-to-all over an emulated link"),
    Bench("soak", ("--minutes", "1", "--launcher", "fork"), what="memory and step time over time"),
    Bench("cuda_check", (), needs="cuda", what="the CUDA path: streams, events, NCCL, memory"),
    Bench("float8_check", ("--device", "cpu", "--emulate", "--steps", "3"), needs="torchao",
          what="torchao float8 linears under Piper against plain float8 (emulated on a CPU)"),
)


def missing(need: str | None) -> str | None:
    """Why this machine cannot run a benchmark that needs ``need`` (None: it can)."""
    if need == "cuda":
        import torch
        return None if torch.cuda.is_available() else "no CUDA device here"
    if need == "torchao":
        from importlib.util import find_spec
        return None if find_spec("torchao") else "torchao is not installed"
    if need == "netns":
        if not (shutil.which("unshare") and shutil.which("tc")):
            return "needs unshare and tc (iproute2)"
        if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode:
            return "cannot make a private network namespace (needs root)"
    return None


def run(bench: Bench, out: Path, timeout: float) -> dict:
    target = os.path.relpath(out / f"{bench.name}.md", ROOT)  # the results file names its command as run
    command = [sys.executable, "-m", f"benchmarks.{bench.name}", *bench.args, "--out", target]
    shown = " ".join(["python -m", f"benchmarks.{bench.name}", *bench.args, "--out", target])
    reason = missing(bench.needs)
    if reason:  # nothing written: the command as it would run, without a results file
        return dict(status=f"skipped: {reason}", seconds=0.0, command=" ".join(["python -m", f"benchmarks.{bench.name}",
                                                                              *bench.args]))
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        tail = (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        status, tail = f"failed: over {timeout:.0f} s", ""
    return dict(status=status, seconds=time.perf_counter() - start, command=shown, tail=tail)


def tables(text: str) -> list[list[dict[str, str]]]:
    """The markdown tables of ``text``: each a list of rows, header -> cell (bold marks removed)."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip().replace("**", "") for c in line.strip().strip("|").split("|")])
            continue
        if len(block) > 2:
            found.append([dict(zip(block[0], row)) for row in block[2:]])
        block = []
    return found


def number(cell: str) -> float | None:
    m = re.match(r"\s*(-?[0-9.]+(?:e[-+]?\d+)?)", cell or "")
    return float(m.group(1)) if m else None


def host_ratios(texts: dict[str, str]) -> list[tuple[str, float]]:
    """(label, Piper over the host engine, higher is better for Piper) from the A/B benchmarks."""
    out = []
    for name, column, invert in (("pipelining_ab", "ratio Piper/torch", True),
                                 ("megatron_ab", "ratio Piper/Megatron", True), ("compile_ab", "piper / torch", False)):
        for table in tables(texts.get(name, "")):
            for row in table:
                value = number(row.get(column, ""))
                if value:
                    label = row.get("schedule", "?") + (f" {row['stages']}" if row.get("stages") else "")
                    out.append((f"{name}: {label}", 1 / value if invert else value))
    for table in tables(texts.get("torchtitan_ab", "")):  # tokens/s per engine, per schedule
        by = {}
        for row in table:
            if "engine" in row and number(row.get("median tokens/s", "")):
                by.setdefault(row["schedule"], {})[row["engine"]] = number(row["median tokens/s"])
        out += [(f"torchtitan_ab: {s}", e["piper"] / e["torch"]) for s, e in by.items() if {"piper", "torch"} <= set(e)]
    return out


def memory_pairs(texts: dict[str, str]) -> list[tuple[str, float, float]]:
    """(label, simulated, measured) KiB per schedule and rank from memory_check."""
    out = []
    for table in tables(texts.get("memory_check", "")):
        for row in table:
            sim, meas = number(row.get("simulated KiB", "")), number(row.get("measured KiB", ""))
            if sim and meas:
                out.append((f"{row['schedule']} r{row['rank']}", sim, meas))
    return out


def predictions(texts: dict[str, str]) -> list[tuple[str, float, float]]:
    """(label, simulated, measured): calibrate's step times (ms), tune_ab's predicted steps of
    every plan it trained (ms, medians over its rounds) and ep_overlap's bubbles (%)."""
    out = [(f"step {m.group(1)}", float(m.group(2)), float(m.group(3)))
           for m in re.finditer(r"calibrate\s+(.+?): predicted ([0-9.]+) ms, measured ([0-9.]+) ms", texts.get("tune_ab", ""))]
    for table in tables(texts.get("tune_ab", "")):
        for row in table:
            measured, ratio = number(row.get("median (ms)", "")), number(row.get("median", "").strip("*"))
            if measured and ratio:
                out.append((f"step {row['plan']}", ratio * measured, measured))
    for table in tables(texts.get("ep_overlap", "")):
        for row in table:
            meas, sim = number(row.get("bubble measured", "")), number(row.get("bubble simulated", ""))
            if meas is not None and sim is not None and row.get("engine") == "piper":
                out.append((f"bubble % {row['schedule']}", sim, meas))
    return out


def plots(texts: dict[str, str], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    ratios = host_ratios(texts)
    if ratios:
        fig, ax = plt.subplots(figsize=(7, 0.4 * len(ratios) + 1.2))
        ax.barh([r[0] for r in ratios], [r[1] for r in ratios], color="tab:blue")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set(xlabel="Piper throughput / host engine's (>1: Piper faster)", title="Piper against the host engines")
        made.append(_save(fig, out / "host_ratios.png"))
    pairs = memory_pairs(texts)
    if pairs:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = range(len(pairs))
        ax.bar([x - 0.2 for x in xs], [p[1] for p in pairs], width=0.4, label="simulated")
        ax.bar([x + 0.2 for x in xs], [p[2] for p in pairs], width=0.4, label="measured (meter)")
        ax.set_xticks(list(xs), [p[0] for p in pairs], rotation=45, ha="right")
        ax.set(ylabel="KiB at peak", title="memory_check: simulated vs measured transient memory")
        ax.legend()
        made.append(_save(fig, out / "memory.png"))
    predicted = predictions(texts)
    if predicted:
        fig, ax = plt.subplots(figsize=(5, 5))
        for label, sim, meas in predicted:
            ax.scatter(meas, sim, color="tab:orange" if label.startswith("bubble") else "tab:green")
        top = max(max(p[1], p[2]) for p in predicted) * 1.1
        ax.plot([0, top], [0, top], color="black", linewidth=0.8)
        ax.set(xlabel="measured", ylabel="simulated", title="simulator vs measurement\n(green: step ms, orange: bubble %)")
        made.append(_save(fig, out / "simulated_vs_measured.png"))
    return made


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def report(runs: dict[str, dict], texts: dict[str, str], made: list[Path], commit: str, seconds: float) -> str:
    import torch
    rel = os.path.relpath(OUT, REPORT.parent)
    lines = ["# Results", "",
             f"Made by `python -m benchmarks.run_all` at {commit} in {seconds / 60:.1f} min on torch {torch.__version__}, "
             f"Python {platform.python_version()}, {os.cpu_count()} CPU cores. Every benchmark at a size that fits this "
             "machine: the figures are small-size runs, noisy where they time a shared machine; the canonical larger "
             "runs and their history are in [benchmarks.md](benchmarks.md).", "",
             "| benchmark | what | status | minutes |", "|---|---|---|---|"]
    for bench in BENCHES:
        if bench.name in runs:
            r = runs[bench.name]
            lines.append(f"| [{bench.name}](#{bench.name}) | {bench.what} | {r['status']} | {r['seconds'] / 60:.1f} |")
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({rel}/{p.name})" for p in made] + [""]
    for bench in BENCHES:
        if bench.name not in runs:
            continue
        r = runs[bench.name]
        lines += [f"## {bench.name}", "", f"Command: `{r['command']}` ({r['status']})", ""]
        if bench.name in texts:
            lines += [f"Results file: [{bench.name}.md]({rel}/{bench.name}.md)", ""]
            for table in tables(texts[bench.name]):
                head = list(table[0])
                lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                lines += ["| " + " | ".join(row.get(h, "") for h in head) + " |" for row in table] + [""]
        elif r.get("tail"):
            lines += ["```", r["tail"].strip()[-800:], "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b.name for b in BENCHES]
    ap.add_argument("--only", nargs="+", choices=names, help="run these benchmarks only")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one benchmark may take")
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    start = time.perf_counter()
    runs, texts = {}, {}
    for bench in BENCHES:
        if args.only and bench.name not in args.only:
            continue
        print(f"run_all  {bench.name} ...", flush=True)
        runs[bench.name] = run(bench, OUT, args.timeout)
        print(f"run_all  {bench.name}: {runs[bench.name]['status']} in {runs[bench.name]['seconds']:.0f} s", flush=True)
        path = OUT / f"{bench.name}.md"
        if runs[bench.name]["status"] == "ok" and path.exists():
            texts[bench.name] = path.read_text()
    made = plots(texts, OUT)
    args.report.write_text(report(runs, texts, made, commit, time.perf_counter() - start))
    print(f"wrote {os.path.relpath(args.report, ROOT)} ({(time.perf_counter() - start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
