"""The demo's report: numbers read off the event log, and the two PNG plots.

``log_numbers(events)`` derives every count the summary states about the fleet
(faults, restarts, recoveries, requests, refits) from the controller's event log
alone, so a reader can re-check the summary against ``events.jsonl``.

``plot_learning`` draws reward and logprob mismatch per step; ``plot_timeline``
draws each shard's health state, the dispatch gate and the refit phases over
time, with the faults, kills, restarts and re-admissions marked. Both use
matplotlib's Agg backend (no display needed) and return the PNG path.

Pure functions of their inputs: no Ray, no vLLM.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median
from typing import Any, Iterable, Sequence

REFIT_PHASES = ("close", "staleness", "reconcile", "pause", "transfer", "stamp", "resume", "reopen")
STATE_COLORS = {
    "starting": "#c7c7c7",
    "restarting": "#6baed6",
    "healthy": "#41ab5d",
    "stale": "#fdd835",
    "suspect": "#fd8d3c",
    "hung": "#9e6bd6",
    "dead": "#d7301f",
    "retired": "#252525",
}
PHASE_COLORS = {"pause": "#fdae6b", "transfer": "#3182bd", "resume": "#74c476"}
OTHER_PHASE_COLOR = "#bdbdbd"
# The controller's own ``stopped`` record when it is shut down on purpose (not a failure).
SHUTDOWN_REASON = "controller shut down"


# ---------------------------------------------------------------------------------- numbers
def restarted_incarnations(events: Iterable[dict]) -> list[tuple[int, int]]:
    """(slot, incarnation) of every replacement engine that started (restart end with outcome ok)."""
    return [
        (e["slot"], e["incarnation"])
        for e in events
        if e["kind"] == "restart" and e.get("edge") == "end" and e.get("outcome") == "ok"
    ]


def readmissions(events: Sequence[dict]) -> list[dict]:
    """Each restarted incarnation's first stamp (it received the weights and rejoined serving), in log order.

    A *recovery* is one such re-admission: a replacement engine that started after a
    death and was later stamped with a committed weight version by a refit.
    """
    started: dict[tuple[int, int], float] = {}
    out: list[dict] = []
    seen: set[tuple[int, int]] = set()
    for e in events:
        if e["kind"] == "restart" and e.get("edge") == "end" and e.get("outcome") == "ok":
            started[(e["slot"], e["incarnation"])] = e["t"]
        elif e["kind"] == "stamp":
            for slot, inc in e["members"]:
                key = (slot, inc)
                if key in started and key not in seen:
                    seen.add(key)
                    out.append({"slot": slot, "incarnation": inc, "version": e["version"], "t": e["t"],
                                "restart_end_t": started[key]})
    return out


def served_by(events: Iterable[dict], pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Completed requests per (slot, incarnation) among ``pairs``."""
    want = {tuple(p): 0 for p in pairs}
    for e in events:
        if e["kind"] == "request" and e["event"] == "completed":
            key = (e["slot"], e["incarnation"])
            if key in want:
                want[key] += 1
    return want


def refit_spans(events: Iterable[dict]) -> list[dict]:
    """One record per refit: version, begin/end time (close begin .. reopen end) and its phases' spans."""
    spans: dict[int, dict] = {}
    open_phase: dict[tuple[int, str], float] = {}
    for e in events:
        if e["kind"] != "phase" or e.get("phase") not in REFIT_PHASES:
            continue
        v = e.get("version")
        rec = spans.setdefault(v, {"version": v, "begin": e["t"], "end": None, "phases": []})
        if e["edge"] == "begin":
            open_phase[(v, e["phase"])] = e["t"]
        else:
            t0 = open_phase.pop((v, e["phase"]), e["t"] - float(e.get("seconds", 0.0)))
            rec["phases"].append((e["phase"], t0, e["t"]))
            rec["end"] = e["t"]
    return [s for s in spans.values() if s["end"] is not None]


def log_numbers(events: Sequence[dict]) -> dict[str, Any]:
    """Every fleet-side number of the summary, from the event log alone."""
    req = {"accepted": 0, "completed": 0, "returned": 0, "requeued": 0}
    for e in events:
        if e["kind"] == "request" and e["event"] in req:
            req[e["event"]] += 1
    faults = [e for e in events if e["kind"] == "fault"]
    readm = readmissions(events)
    started = restarted_incarnations(events)
    served = served_by(events, [(r["slot"], r["incarnation"]) for r in readm])
    gate_opens = [e for e in events if e["kind"] == "gate" and e["open"]]
    first_fault_t = min((e["t"] for e in faults), default=None)
    refits = [s for s in refit_spans(events) if s["version"] is not None]
    refit_s = [s["end"] - s["begin"] for s in refits]
    return {
        "requests": req,
        "prompts_lost": req["accepted"] - req["completed"] - req["returned"],
        "faults_injected": len(faults),
        "faults": [{k: e.get(k) for k in ("t", "slot", "incarnation", "point", "action", "armed")} for e in faults],
        "kills": sum(1 for e in events if e["kind"] == "kill"),
        "deaths": sum(1 for e in events if e["kind"] == "health" and e["after"] == "dead"),
        "restarts_started": sum(1 for e in events if e["kind"] == "restart" and e.get("edge") == "begin"),
        "restarts_ok": len(started),
        "recoveries": len(readm),
        "readmissions": [{**r, "served_after": served[(r["slot"], r["incarnation"])]} for r in readm],
        "gate_reopenings_after_fault": sum(1 for e in gate_opens if first_fault_t is not None and e["t"] > first_fault_t),
        "stopped": next((e["reason"] for e in events if e["kind"] == "stopped" and e["reason"] != SHUTDOWN_REASON), None),
        "refits": len(refits),
        "refit_s_p50": round(median(refit_s), 3) if refit_s else None,
        "refit_s_max": round(max(refit_s), 3) if refit_s else None,
        "staleness_aborts": sum(e.get("requests", 0) for e in events if e["kind"] == "staleness_abort"),
    }


# ---------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _finite(xs: Iterable[Any]) -> list[float]:
    return [float(x) if x is not None and math.isfinite(float(x)) else math.nan for x in xs]


def plot_learning(
    rows: Sequence[dict],
    path: str | Path,
    chance: float | None = None,
    marks: Sequence[tuple[float, str, str]] = (),
    final: dict | None = None,
    title: str = "",
) -> Path:
    """Reward (mean and max) and train-vs-rollout logprob mismatch per step.

    ``rows``: per-step metrics with ``step``, ``reward_mean``, ``reward_max``,
    ``audit_mismatch_max``/``_mean`` (trainer under the generating weights vs the
    engine) and ``mismatch_max`` (trainer after its update: includes the policy lag).
    ``marks``: (step, label, color) vertical lines, e.g. the kill and the re-admission.
    ``final``: the evaluation after the last refit (``reward_mean``, ``audit_mismatch_max``).
    """
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, (ax_r, ax_m) = plt.subplots(2, 1, figsize=(8.0, 5.6), sharex=True, dpi=100,
                                     gridspec_kw={"height_ratios": [3, 2]})
    ax_r.plot(steps, _finite(r.get("reward_mean") for r in rows), "o-", ms=3, color="#2171b5", label="reward (mean)")
    ax_r.plot(steps, _finite(r.get("reward_max") for r in rows), "-", lw=0.8, color="#9ecae1", label="reward (max)")
    if chance is not None:
        ax_r.axhline(chance, ls=":", color="grey", lw=1, label=f"chance ({chance:.3f})")
    if final and final.get("reward_mean") is not None:
        ax_r.plot([len(rows)], [final["reward_mean"]], "*", ms=11, color="#08306b", label="final eval")
    ax_r.set_ylim(0, 1.02)
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)

    fresh = _finite(r.get("audit_mismatch_max") for r in rows)
    fresh_mean = _finite(r.get("audit_mismatch_mean") for r in rows)
    lag = _finite(r.get("mismatch_max") for r in rows)
    floor = 1e-9
    ax_m.semilogy(steps, [max(x, floor) if not math.isnan(x) else x for x in fresh], "o-", ms=3, color="#cb181d",
                  label="fresh: max |trainer - engine| (same weights)")
    ax_m.semilogy(steps, [max(x, floor) if not math.isnan(x) else x for x in fresh_mean], "-", lw=0.8,
                  color="#fc9272", label="fresh: mean")
    ax_m.semilogy(steps, [max(x, floor) if not math.isnan(x) else x for x in lag], "s--", ms=2.5, lw=0.8,
                  color="#737373", label="with 1-version lag (trainer after update)")
    if final and final.get("audit_mismatch_max") is not None and math.isfinite(final["audit_mismatch_max"]):
        ax_m.semilogy([len(rows)], [max(final["audit_mismatch_max"], floor)], "*", ms=11, color="#67000d")
    ax_m.set_ylabel("logprob mismatch")
    ax_m.set_xlabel("training step")
    ax_m.grid(alpha=0.3, which="both")
    for ax in (ax_r, ax_m):
        for x, label, color in marks:
            ax.axvline(x, color=color, ls="--", lw=1)
    ymax = ax_r.get_ylim()[1]
    for x, label, color in marks:
        right = x > 0.8 * max(len(rows), 1)
        ax_r.text(x, ymax * 0.98, f" {label} " if not right else f"{label} ", color=color, fontsize=8, va="top",
                  ha="right" if right else "left")
    ax_r.legend(loc="upper left", fontsize=8)
    ax_m.legend(loc="center right", fontsize=7)
    return _save(fig, ax_r, title, path)


def _save(fig, ax, title: str | None, path) -> Path:
    """Title the top axes, lay out, write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def state_segments(events: Sequence[dict], t_end: float) -> dict[int, list[tuple[float, float, str, int]]]:
    """Per slot: (t0, t1, state, incarnation) segments from the health events (a slot starts 'starting')."""
    t_first = events[0]["t"] if events else 0.0
    current: dict[int, tuple[float, str, int]] = {}
    segs: dict[int, list[tuple[float, float, str, int]]] = {}
    for e in events:
        if e["kind"] != "health":
            continue
        slot = e["slot"]
        t0, state, inc = current.get(slot, (t_first, "starting", e["incarnation"]))
        if e["t"] > t0:
            segs.setdefault(slot, []).append((t0, e["t"], state, inc))
        current[slot] = (e["t"], e["after"], e["incarnation"])
    for slot, (t0, state, inc) in current.items():
        segs.setdefault(slot, []).append((t0, max(t_end, t0), state, inc))
    return segs


def gate_segments(events: Sequence[dict], t_end: float) -> list[tuple[float, float, bool]]:
    t_first = events[0]["t"] if events else 0.0
    out, t0, is_open = [], t_first, False
    for e in events:
        if e["kind"] == "gate":
            if e["t"] > t0:
                out.append((t0, e["t"], is_open))
            t0, is_open = e["t"], bool(e["open"])
    out.append((t0, max(t_end, t0), is_open))
    return out


def plot_timeline(
    events: Sequence[dict],
    path: str | Path,
    t0: float | None = None,
    step_times: Sequence[float] = (),
    title: str = "",
    size: tuple[float, float] = (10.0, 4.2),
    crop_startup: bool = True,
    holds: Sequence[tuple[float, float, str]] = (),
) -> Path:
    """Each shard's state, the gate and the refit phases over time (seconds from ``t0``).

    Marked on the slot rows: a fault (red x), a kill (black v), a restart (blue
    bracket from begin to end), a re-admission (green star at the stamp that brought
    the new incarnation in). ``step_times``: training-step starts, drawn as light
    vertical lines. ``crop_startup`` (with ``t0`` unset): time 0 is the gate's first
    opening; engine start-up, often most of a short run on CPU, is cut to a short
    lead-in and its length is printed under the axis. ``holds``: (t0, t1, label)
    periods the driver held training (shaded and labelled).
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("no events to plot")
    t_end = events[-1]["t"]
    t_open = next((e["t"] for e in events if e["kind"] == "gate" and e["open"]), None)
    startup_s = None
    if t0 is None:
        t0 = events[0]["t"]
        if crop_startup and t_open is not None:
            startup_s, t0 = t_open - t0, t_open
    slots = sorted({e["slot"] for e in events if e["kind"] == "health"})
    rows = {slot: i for i, slot in enumerate(slots)}
    gate_y, refit_y = len(slots), len(slots) + 1
    fig, ax = plt.subplots(figsize=size, dpi=100)
    h = 0.7

    for slot, segs in state_segments(events, t_end).items():
        y = rows[slot]
        ax.broken_barh([(a - t0, b - a) for a, b, _, _ in segs], (y - h / 2, h),
                       facecolors=[STATE_COLORS.get(s, "#ffffff") for _, _, s, _ in segs], edgecolor="none")
        last_inc = None
        for a, b, _, inc in segs:
            if inc != last_inc:
                ax.text(max(a - t0, 0.0), y + h / 2 + 0.02, f"inc {inc}", fontsize=6.5, va="bottom", ha="left", color="#444444")
                last_inc = inc
    gates = gate_segments(events, t_end)
    ax.broken_barh([(a - t0, b - a) for a, b, _ in gates], (gate_y - h / 2, h),
                   facecolors=["#41ab5d" if o else "#969696" for _, _, o in gates], edgecolor="none")
    for span in refit_spans(events):
        if span["version"] is None:
            continue
        bars = [(a - t0, max(b - a, 0.15)) for _, a, b in span["phases"]]
        colors = [PHASE_COLORS.get(p, OTHER_PHASE_COLOR) for p, _, _ in span["phases"]]
        ax.broken_barh(bars, (refit_y - h / 2, h), facecolors=colors, edgecolor="none")

    for e in events:
        if e["kind"] == "fault" and e["slot"] in rows:
            ax.plot(e["t"] - t0, rows[e["slot"]], "x", color="#a50f15", ms=10, mew=2.5, zorder=5)
        elif e["kind"] == "kill" and e["slot"] in rows:
            ax.plot(e["t"] - t0, rows[e["slot"]] - 0.05, "v", color="black", ms=6, zorder=5)
    begins = {}
    for e in events:
        if e["kind"] == "restart" and e["slot"] in rows:
            key = (e["slot"], e["incarnation"])
            if e.get("edge") == "begin":
                begins[key] = e["t"]
            elif key in begins:
                y = rows[e["slot"]] - h / 2 - 0.08
                ax.annotate("", xy=(e["t"] - t0, y), xytext=(begins[key] - t0, y),
                            arrowprops=dict(arrowstyle="|-|", color="#08519c", lw=1.2, mutation_scale=3))
                ax.text((begins[key] + e["t"]) / 2 - t0, y - 0.05, "restart", fontsize=7, color="#08519c",
                        ha="center", va="top")
    for r in readmissions(events):
        if r["slot"] in rows:
            ax.plot(r["t"] - t0, rows[r["slot"]], "*", color="#00441b", ms=14, mec="white", zorder=6)
            right = (r["t"] - t0) > 0.75 * max(t_end - t0, 1.0)
            ax.text(r["t"] - t0, rows[r["slot"]] + 0.05, f"re-admitted (v{r['version']}) ", fontsize=7,
                    color="#00441b", va="bottom", ha="right" if right else "left", zorder=6)

    for ts in step_times:
        ax.axvline(ts - t0, color="#d9d9d9", lw=0.5, zorder=0)
    for a, b, label in holds:
        ax.axvspan(a - t0, b - t0, color="#fee391", alpha=0.35, lw=0, zorder=0)
        ax.text((a + b) / 2 - t0, refit_y, label, fontsize=7, ha="center", va="center", color="#8c510a")
    ax.set_yticks([*rows.values(), gate_y, refit_y], [*(f"slot {s}" for s in slots), "gate", "refit"])
    ax.set_ylim(-0.8, refit_y + 0.6)
    span = max(t_end - t0, 1.0)
    lead = min(startup_s, 0.04 * span) if startup_s is not None else 0.0
    ax.set_xlim(-lead, span * 1.01)
    steps_note = "; grey lines: training steps" if step_times else ""
    if startup_s is not None:
        ax.set_xlabel(f"seconds since the gate first opened (engines took {startup_s:.0f} s to start){steps_note}")
    else:
        ax.set_xlabel(f"seconds{steps_note}")
    legend = [Patch(color=STATE_COLORS[s], label="healthy / gate open" if s == "healthy" else s)
              for s in ("starting", "healthy", "stale", "dead", "restarting", "suspect")]
    legend += [Patch(color="#969696", label="gate closed")]
    legend += [Patch(color=PHASE_COLORS[p], label=f"refit: {p}") for p in ("pause", "transfer", "resume")]
    legend += [Patch(color=OTHER_PHASE_COLOR, label="refit: other")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              ncol=6, fontsize=7, frameon=False)
    return _save(fig, ax, title, path)
