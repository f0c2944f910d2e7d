"""SVG message-sequence chart of a replayed world.

One vertical lane per node, virtual time flowing down. Every message that concerns the chosen
requests is an arrow from its sender's lane at send time to its receiver's lane at arrival time;
a lost message ends in a red cross (drop, partition, overflow, dead receiver). Crashes, restarts,
faults and the violation are marked across the lanes. Time is compressed: only instants where
something is drawn get vertical space, so a 30 s run with a 2 ms race stays readable.
"""
from __future__ import annotations

import re
from html import escape
from typing import Any

from mpcache.sim.trace import Mark, MessageRecord

LANE_W = 130
ROW_H = 16
TOP = 60
LEFT = 90


def requests_in(text: str) -> set[str]:
    return set(re.findall(r"\br\d+\b", text))


def render(world: Any, request_ids: set[str] | None = None, max_messages: int = 400) -> str:
    trace = world.trace
    msgs: list[MessageRecord] = sorted(trace.messages.values(), key=lambda m: (m.sent, m.pid))
    if request_ids:
        msgs = [m for m in msgs if m.request_id in request_ids]
    msgs = [m for m in msgs if m.label != "Ping" and not (m.label == "reply:True")]
    msgs = msgs[-max_messages:]
    marks: list[Mark] = [mk for mk in trace.marks if mk.kind in ("crash", "restart", "VIOLATION", "fault", "heal")]
    nodes: list[str] = []

    def lane(name: str) -> None:
        if name not in nodes and name != "-":
            nodes.append(name)

    for m in msgs:
        lane(m.src)
        lane(m.dst)
    for mk in marks:
        lane(mk.node)
    nodes.sort(key=lambda n: (0 if n.startswith("sched") else 1 if n.startswith("worker") else 2, n))
    if not nodes:
        nodes = ["-"]
    times = sorted({round(t, 9) for m in msgs for t in (m.sent, m.arrived if m.arrived is not None else m.sent)}
                   | {round(mk.t, 9) for mk in marks})
    row = {t: i for i, t in enumerate(times)}

    def y(t: float) -> float:
        return TOP + row[round(t, 9)] * ROW_H + ROW_H

    def x(node: str) -> float:
        return LEFT + (nodes.index(node) if node in nodes else 0) * LANE_W + LANE_W / 2

    height = TOP + (len(times) + 2) * ROW_H
    width = LEFT + len(nodes) * LANE_W + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="10">',
           '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="8" refY="4" orient="auto">'
           '<path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>',
           f'<text x="8" y="16" font-size="12">mpcache-sim seed {world.scenario.seed} profile {world.profile.name}'
           f'{" requests " + ",".join(sorted(request_ids)) if request_ids else ""}</text>']
    for n in nodes:
        out.append(f'<text x="{x(n)}" y="{TOP - 12}" text-anchor="middle" font-weight="bold">{escape(n)}</text>')
        out.append(f'<line x1="{x(n)}" y1="{TOP}" x2="{x(n)}" y2="{height - ROW_H}" stroke="#bbb"/>')
    for t in times:
        out.append(f'<text x="4" y="{y(t) + 3}" fill="#888">{t:.6f}</text>')
    for m in msgs:
        x1, y1 = x(m.src), y(m.sent)
        lost = m.fate not in ("delivered", "in-flight")
        if m.arrived is not None and not lost:
            x2, y2 = x(m.dst), y(m.arrived)
        else:
            x2, y2 = (x(m.src) + x(m.dst)) / 2, y1 + ROW_H / 2
        color = "#c00" if lost else ("#06c" if m.src.startswith(("sched", "worker")) else "#090")
        arrow = "" if lost else ' marker-end="url(#a)"'
        out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}"{arrow}/>')
        label = escape(f"{m.label} {m.request_id or ''}".strip())
        out.append(f'<text x="{(x1 + x2) / 2 + 3}" y="{(y1 + y2) / 2 - 2}" fill="{color}">{label}</text>')
        if lost:
            out.append(f'<text x="{x2 - 4}" y="{y2 + 4}" fill="#c00" font-size="14">x</text>'
                       f'<text x="{x2 + 8}" y="{y2 + 4}" fill="#c00">{escape(m.fate)}</text>')
    for mk in marks:
        color = {"crash": "#c00", "restart": "#090", "VIOLATION": "#c0c", "fault": "#e80", "heal": "#090"}[mk.kind]
        yy = y(mk.t)
        if mk.node in nodes:
            out.append(f'<rect x="{x(mk.node) - 50}" y="{yy - 9}" width="100" height="12" fill="{color}" '
                       f'fill-opacity="0.2" stroke="{color}"/>')
        else:
            out.append(f'<line x1="{LEFT}" y1="{yy}" x2="{width - 20}" y2="{yy}" stroke="{color}" '
                       f'stroke-dasharray="4,3"/>')
        out.append(f'<text x="{LEFT + 4}" y="{yy - 2}" fill="{color}">{escape(mk.kind + " " + mk.text[:160])}</text>')
    out.append("</svg>")
    return "\n".join(out)
