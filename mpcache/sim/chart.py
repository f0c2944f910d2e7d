"""Message-sequence chart of a replayed world (drawn with matplotlib, `sim/plot.py`).

One vertical lane per node, virtual time flowing down. Every message that concerns the chosen
requests is an arrow from its sender's lane at send time to its receiver's lane at arrival time;
a lost message ends in a red cross with its fate (drop, partition, overflow, dead receiver).
Crashes, restarts, faults and the violation are marked on their node's lane, or across the lanes.

Time is compressed to one row per thing drawn (a send, an arrival, a mark), in time order, each
row as tall as its wrapped text: a 30 s run with a 2 ms race stays readable, and no two labels
share a row, so none overlap. The y axis names each row's virtual time.
"""
from __future__ import annotations

import re
from typing import Any

from mpcache.sim.plot import pyplot, wrap
from mpcache.sim.trace import Mark, MessageRecord

LANE_IN = 1.9  # inches between lanes
ROW_IN = 0.17  # inches per text line
LABEL_CHARS = 30  # a message label wraps at this many characters (fits between two lanes)
MARK_CHARS = 70
COLORS = {"crash": "#c00", "restart": "#090", "VIOLATION": "#c0c", "fault": "#e80", "heal": "#090"}


def requests_in(text: str) -> set[str]:
    return set(re.findall(r"\br\d+\b", text))


def _lane_order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("sched") else 1 if name.startswith("worker") else 2, name)


def figure(world: Any, request_ids: set[str] | None = None, max_messages: int = 400) -> Any:
    """The chart of `world`'s recorded messages (those of `request_ids` when given) as a
    matplotlib Figure; `plot.save` writes it."""
    plt = pyplot()
    trace = world.trace
    msgs: list[MessageRecord] = sorted(trace.messages.values(), key=lambda m: (m.sent, m.pid))
    if request_ids:
        msgs = [m for m in msgs if m.request_id in request_ids]
    msgs = [m for m in msgs if m.label != "Ping" and m.label != "reply:True"][-max_messages:]
    marks: list[Mark] = [mk for mk in trace.marks if mk.kind in COLORS]
    nodes = sorted({n for m in msgs for n in (m.src, m.dst)} | {mk.node for mk in marks}, key=_lane_order)
    nodes = [n for n in nodes if n != "-"] or ["-"]
    lane = {n: i for i, n in enumerate(nodes)}

    def lost(m: MessageRecord) -> bool:
        return m.fate not in ("delivered", "in-flight")

    def label(m: MessageRecord) -> str:
        fate = f" ({m.fate})" if lost(m) else " (in flight)" if m.arrived is None else ""
        text = f"{m.label} {m.request_id or ''}".strip() + fate
        return wrap(text, LABEL_CHARS)

    def mark_text(mk: Mark) -> str:
        return wrap(f"{mk.kind} {mk.text}", MARK_CHARS)

    # rows: (time, order, kind, item); a send before an arrival at the same instant
    rows: list[tuple[float, int, str, Any]] = []
    for m in msgs:
        rows.append((m.sent, 0, "send", m))
        if m.arrived is not None and not lost(m):
            rows.append((m.arrived, 1, "arrive", m))
    rows += [(mk.t, 2, "mark", i) for i, mk in enumerate(marks)]
    rows.sort(key=lambda r: (r[0], r[1], r[3] if r[2] == "mark" else r[3].pid))
    y_send: dict[int, float] = {}
    y_arrive: dict[int, float] = {}
    y_mark: dict[int, float] = {}
    ticks: list[tuple[float, float]] = []
    y = 0.0
    for t, _, kind, item in rows:
        text = label(item) if kind == "send" else mark_text(marks[item]) if kind == "mark" else ""
        y += text.count("\n") + 1
        if kind == "send":
            y_send[item.pid] = y
        elif kind == "arrive":
            y_arrive[item.pid] = y
        else:
            y_mark[item] = y
        ticks.append((y, t))
    height = y + 1

    fig_w = 1.5 + LANE_IN * max(len(nodes), 2)
    fig, ax = plt.subplots(figsize=(fig_w, 1.6 + ROW_IN * height))
    ax.set_xlim(-0.5, len(nodes) - 0.5)
    ax.set_ylim(height, 0)
    for i in range(len(nodes)):
        ax.axvline(i, color="#bbb", lw=0.8, zorder=0)
    ax.set_xticks(range(len(nodes)), [wrap(n, 14) for n in nodes], fontweight="bold", fontsize=8)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("node")
    ax.set_yticks([yy for yy, _ in ticks], [f"{t:.6f}" for _, t in ticks], fontsize=6, fontfamily="monospace")
    ax.set_ylabel("virtual time (s)\none row per send, arrival or mark")
    for side in ("right", "bottom"):
        ax.spines[side].set_visible(False)

    for m in msgs:
        x1, y1 = lane[m.src], y_send[m.pid]
        color = "#c00" if lost(m) else ("#06c" if m.src.startswith(("sched", "worker")) else "#090")
        x2 = lane[m.dst]
        if lost(m) or m.pid not in y_arrive:
            xe, ye = (x1 + x2) / 2, y1 + 0.5
            ax.plot([x1, xe], [y1, ye], color=color, lw=0.8, ls="-" if lost(m) else ":")
            if lost(m):
                ax.plot([xe], [ye], marker="x", color=color, ms=6)
        else:
            ax.annotate("", xy=(x2, y_arrive[m.pid]), xytext=(x1, y1),
                        arrowprops={"arrowstyle": "->", "color": color, "lw": 0.8, "shrinkA": 0, "shrinkB": 0})
        right = x2 >= x1
        ax.text(x1 + (0.04 if right else -0.04), y1 - 0.1, label(m), color=color, fontsize=7,
                fontfamily="monospace", ha="left" if right else "right", va="bottom", linespacing=1.0)
    for i, mk in enumerate(marks):
        color, yv = COLORS[mk.kind], y_mark[i]
        if mk.node in lane:
            x = lane[mk.node]
            ax.plot([x], [yv], marker="s", color=color, ms=7, alpha=0.6)
            ax.text(x + 0.06, yv - 0.1, mark_text(mk), color=color, fontsize=7, ha="left", va="bottom",
                    linespacing=1.0, bbox={"facecolor": "white", "edgecolor": color, "alpha": 0.85, "pad": 1})
        else:
            ax.axhline(yv, color=color, ls="--", lw=0.8)
            ax.text(-0.45, yv - 0.1, mark_text(mk), color=color, fontsize=7, ha="left", va="bottom",
                    linespacing=1.0, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1})
    title = f"mpcache-sim replay {world.scenario.seed} --profile {world.profile.name}"
    if request_ids:
        title += f": requests {', '.join(sorted(request_ids))}"
    chars = int(fig_w * 72 / 6)  # about 6 points per character at 10 pt
    ax.set_title(wrap(title, chars), loc="left", fontsize=10, pad=30)  # above the lane names
    return fig
