"""Plan export: a step x rank text grid, a Chrome trace and a timeline picture.

Readers only: nothing here changes a :class:`Plan` or a :class:`SimResult`. Every compute
task of the plan appears in the grid; every simulated task appears once in the trace.
Data-parallel / expert-parallel replicas whose compute is identical share one grid column.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from piper_plugin.ir.nodes import Kind
from piper_plugin.scheduler.plan import Plan
from piper_plugin.scheduler.simulate import SimResult

__all__ = ["plan_grid_text", "chrome_trace", "timeline_png", "box_label", "KIND_COLORS"]

# One hue per kind (matplotlib's tab10 / tab20), so kinds stay apart whatever the schedule; a
# rank's later chunk is a lighter shade of its kind's hue (_CHUNK_LIGHTER), never another kind's.
KIND_COLORS: dict[Kind, str] = {
    Kind.F: "#1f77b4", Kind.B: "#2ca02c", Kind.BI: "#ff7f0e", Kind.BW: "#9467bd", Kind.UPDATE: "#8c564b",
    Kind.SEND: "#17becf", Kind.RECV: "#9edae5", Kind.ALL_REDUCE: "#d62728", Kind.ALL_GATHER: "#e377c2",
    Kind.REDUCE_SCATTER: "#bcbd22", Kind.ALL_TO_ALL: "#7f7f7f",
}
_CHUNK_LIGHTER = 0.45
_MAX_TIME_ROWS = 400
_EPS = 1e-6


# -- text grid ------------------------------------------------------------------------------
def plan_grid_text(plan: Plan, result: SimResult | None = None) -> str:
    """Compute actions as rows x ranks, like torch.distributed.pipelining's pipeline order.

    With a ``result`` whose compute times are whole multiples of one unit (uniform costs),
    rows are time slots: a task shows its key where it starts and ``|`` while it runs, an
    empty cell is idle. Otherwise row ``k`` holds each rank's ``k``-th compute task.
    Zero-time tasks (e.g. UPDATE) share a cell, joined by ``+``.
    """
    timed = _time_cells(plan, result) if result is not None else None
    if timed is not None:
        cells, unit = timed
        labels = [f"t={i * unit:g}" for i in range(max(map(len, cells), default=0))]
    else:
        cells = [plan.compute_sequence(r) for r in range(plan.grid.world_size)]
        labels = [f"step {i:02d}" for i in range(max(map(len, cells), default=0))]
    columns = _merge_replicas(cells)
    label_w = max([len(s) for s in labels] + [4])
    widths = [max([len(head)] + [len(c) for c in col]) for head, col in columns]
    lines = [(" " * label_w + "  " + "  ".join(h.ljust(w) for (h, _), w in zip(columns, widths))).rstrip()]
    for i, label in enumerate(labels):
        row = [(col[i] if i < len(col) else "").ljust(w) for (_, col), w in zip(columns, widths)]
        lines.append((label.ljust(label_w) + "  " + "  ".join(row)).rstrip())
    return "\n".join(lines)


def _time_cells(plan: Plan, result: SimResult) -> tuple[list[list[str]], float] | None:
    spans = [(r, k, s, e) for r, _, k, s, e in result.timeline if plan.node(k).is_compute]
    positive = [e - s for _, _, s, e in spans if e - s > _EPS]
    if not positive:
        return None
    unit = min(positive)
    slots = []
    for r, key, start, end in spans:
        a, b = start / unit, end / unit
        if abs(a - round(a)) > _EPS or abs(b - round(b)) > _EPS:
            return None  # not a uniform cost model: fall back to task order
        slots.append((r, key, round(a), round(b)))
    rows = max(max(b, a + 1) for _, _, a, b in slots)
    if rows > _MAX_TIME_ROWS:
        return None
    cells = [[""] * rows for _ in range(plan.grid.world_size)]
    for r, key, a, b in sorted(slots, key=lambda s: (s[0], s[2], s[3])):
        cells[r][a] = f"{cells[r][a]}+{key}" if cells[r][a] else key
        for i in range(a + 1, b):
            cells[r][i] = "|"
    return cells, unit


def _merge_replicas(cells: list[list[str]]) -> list[tuple[str, list[str]]]:
    """Consecutive ranks with identical cells become one column headed ``rank 0,1``."""
    columns: list[tuple[list[int], list[str]]] = []
    for r, col in enumerate(cells):
        if columns and columns[-1][1] == col:
            columns[-1][0].append(r)
        else:
            columns.append(([r], col))
    return [((f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"), col)
            for ranks, col in columns]


# -- Chrome trace ---------------------------------------------------------------------------
def _stream_ids(plan: Plan, result: SimResult) -> list[dict[str, int]]:
    """Per rank: logical stream -> thread id, compute first, then P2P, then collectives."""
    names: list[set[str]] = [set() for _ in range(plan.grid.world_size)]
    for r, stream, *_ in result.timeline:
        names[r].add(stream)
    rank_key = lambda s: (s != "compute", not s.startswith("p2p"), s)  # noqa: E731
    return [{s: i for i, s in enumerate(sorted(n, key=rank_key))} for n in names]


def chrome_trace(plan: Plan, result: SimResult, *, us_per_unit: float = 1e6) -> dict[str, Any]:
    """Chrome / Perfetto trace: one complete ("X") event per simulated task.

    pid = rank, tid = logical stream (named by "M" metadata events), ts / dur in microseconds
    (``us_per_unit`` converts simulator time: 1e6 for seconds, e.g. 1e3 to draw a unit as 1 ms).
    """
    grid = plan.grid
    tids = _stream_ids(plan, result)
    events: list[dict[str, Any]] = []
    for r in range(grid.world_size):
        pp, dp, ep = grid.coords(r)
        events.append({"ph": "M", "name": "process_name", "pid": r,
                       "args": {"name": f"rank {r} (pp={pp} dp={dp} ep={ep})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for stream, tid in tids[r].items():
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid,
                           "args": {"sort_index": tid}})
    for r, stream, key, start, end in result.timeline:
        node = plan.node(key)
        args: dict[str, Any] = {"kind": node.kind.value, "microbatch": node.microbatch,
                                "stage": node.stage, "region": node.region, "stream": stream}
        if node.bytes:
            args["bytes"] = node.bytes
        events.append({"name": key, "cat": "compute" if node.is_compute else "comm", "ph": "X",
                       "pid": r, "tid": tids[r][stream], "ts": start * us_per_unit,
                       "dur": (end - start) * us_per_unit, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"plan_hash": plan.hash(), "grid": grid.to_json(),
                          "microbatches": plan.microbatches, "step_time": result.step_time,
                          "bubble_fraction": result.bubble_fraction}}


# -- timeline picture -----------------------------------------------------------------------
def _row_name(stream: str) -> str:
    return "p2p" if stream.startswith("p2p") else stream


def _lighter(color: str, amount: float) -> str:
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _text_color(color: str) -> str:
    """The label colour with the higher contrast on ``color``: black or white (WCAG luminance)."""
    srgb = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in srgb)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.179 else "white"


def box_label(key: str, microbatch: int | None, width_px: float, char_px: float) -> str:
    """What a compute box shows: its full node key (``0F0``, ``1.1BI3``) where it fits, else
    its microbatch, else nothing."""
    for text in (key, "" if microbatch is None else str(microbatch)):
        if text and len(text) * char_px < width_px - 2:
            return text
    return ""


def _picture_groups(plan: Plan, result: SimResult) -> list[list[int]]:
    """Ranks drawn as one row: consecutive replicas whose whole timeline is identical."""
    per_rank: list[list[tuple]] = [[] for _ in range(plan.grid.world_size)]
    for r, *rest in result.timeline:
        per_rank[r].append(tuple(rest))
    groups: list[list[int]] = []
    for r, events in enumerate(per_rank):
        if groups and sorted(per_rank[groups[-1][0]]) == sorted(events):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def timeline_png(plan: Plan, result: SimResult, path: str | Path, *, title: str | None = None,
                 time_label: str = "time", time_scale: float = 1.0, dpi: int = 100) -> Path:
    """Gantt chart of the simulated step: a row per rank, a thinner sub-row per comm stream.

    Replicas with identical timelines share a row ("ranks 0-1"); all P2P directions of a
    rank share one ``p2p`` sub-row. Bars are coloured by node kind (:data:`KIND_COLORS`), a
    lighter shade of it for a rank's later chunks (interleaved, DualPipeV); each compute bar
    carries :func:`box_label`. The time axis shows ``result``'s times x ``time_scale`` (1e3:
    seconds drawn as milliseconds). Uses Agg without pyplot (no global matplotlib state).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    groups = _picture_groups(plan, result)
    lead = {g[0]: g for g in groups}
    present: dict[int, set[str]] = {r: set() for r in lead}
    stages: dict[int, set[int]] = {r: set() for r in lead}
    for r, stream, key, *_ in result.timeline:
        if r in lead:
            present[r].add(_row_name(stream))
            if plan.node(key).is_compute:
                stages[r].add(plan.node(key).stage)
    rows: dict[tuple[int, str], float] = {}  # (rank, row name) -> y centre (top to bottom)
    ticks: list[tuple[float, str]] = []
    separators: list[float] = []
    y = 0.0
    for r, group in lead.items():
        for name in sorted(present[r], key=lambda s: (s != "compute", s != "p2p", s)):
            height = 1.0 if name == "compute" else 0.6
            rows[(r, name)] = y + height / 2
            label = (f"rank {r}" if len(group) == 1 else f"ranks {group[0]}-{group[-1]}") if name == "compute" else name
            ticks.append((y + height / 2, label))
            y += height
        separators.append(y + 0.1)
        y += 0.2
    step = (result.step_time or 1.0) * time_scale
    timeline = [(r, stream, key, s * time_scale, e * time_scale) for r, stream, key, s, e in result.timeline]
    compute = [(r, k, s, e) for r, _, k, s, e in timeline if r in lead and plan.node(k).is_compute]
    shortest = min([e - s for _, _, s, e in compute if e - s > _EPS] or [step])
    fig_w = min(max(12.0, 5.0 * step / shortest / 25), 24.0)
    fig = Figure(figsize=(fig_w, 1.4 + 0.42 * y), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    char_px = 6.5 * dpi / 72 * 0.62  # width of one label character
    px_per_time = fig_w * dpi * 0.85 / (step * 1.01)
    bars: dict[tuple[Kind, int], list[Rectangle]] = {}
    for r, stream, key, start, end in timeline:
        if r not in lead:
            continue
        node, name = plan.node(key), _row_name(stream)
        height = 0.8 if name == "compute" else 0.45
        yc = rows[(r, name)]
        chunk = sorted(stages[r]).index(node.stage) if node.is_compute and node.stage in stages[r] else 0
        bars.setdefault((node.kind, min(chunk, 1)), []).append(
            Rectangle((start, yc - height / 2), max(end - start, step * 0.004), height))
        text = box_label(key, node.microbatch, (end - start) * px_per_time, char_px) if node.is_compute else ""
        if text:
            ax.text((start + end) / 2, yc, text, ha="center", va="center", fontsize=6.5,
                    color=_text_color(_lighter(KIND_COLORS[node.kind], _CHUNK_LIGHTER * min(chunk, 1))))
    for (kind, chunk), rects in bars.items():
        color = _lighter(KIND_COLORS[kind], _CHUNK_LIGHTER * chunk)
        ax.add_collection(PatchCollection(rects, facecolor=color, edgecolor="white", linewidth=0.4),
                          autolim=False)
    for s in separators[:-1]:
        ax.axhline(s, color="#bbbbbb", linewidth=0.6)
    ax.set_xlim(0, step * 1.01)
    ax.set_ylim(y, 0)
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=16, steps=[1, 2, 5, 10]))
    ax.set_xlabel(time_label)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)
    if title is None:
        g = plan.grid
        title = (f"pp={g.pp} dp={g.dp} ep={g.ep}, {plan.microbatches} microbatches: "
                 f"step {result.step_time:g}, bubble {result.bubble_fraction:.1%}")
    ax.set_title(title, fontsize=11)
    handles = [Patch(color=_lighter(KIND_COLORS[k], _CHUNK_LIGHTER * c),
                     label=k.value + (" (later chunk)" if c else ""))
               for k in Kind for c in (0, 1) if (k, c) in bars]
    fig.legend(handles=handles, ncol=min(len(handles), 8), loc="outside lower center", fontsize=8, frameon=False)
    path = Path(path)
    fig.savefig(path)
    return path
