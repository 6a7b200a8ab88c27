"""The demo's report: the summary of a finished run, and the two PNG plots.

``summarize(run, events, wall_s)`` builds ``summary.json``: the headline numbers
(reward, logprob mismatch, prompts lost, faults, recoveries, step and refit
times, what continuation saved), then what they were computed from. Every fleet number comes from the
event log through ``faults.timeline.log_numbers``, so a reader can re-check the
summary against ``events.jsonl``; ``ok`` also needs every invariant of
``faults.invariants`` to hold.

``continuation_line(summary)`` is the report's line on what continuation saved when a shard died
mid-generation: requests continued on another engine and the tokens they carried over (from the
client's counters, ``continuation_figures``).

``plot_learning`` draws reward and logprob mismatch per step; ``plot_timeline``
draws each shard's health state, the dispatch gate and the refit phases over
time, with the faults, kills, restarts and re-admissions marked. Both use
matplotlib's Agg backend (no display needed) and return the PNG path.

Pure functions of their inputs: no Ray, no vLLM.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlfleet.faults import invariants
from rlfleet.faults.timeline import log_numbers, percentile, readmissions, refit_spans
from rlfleet.fleet.records import Fault, Gate, Health, Kill, Record, Restart, all_of

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


# ---------------------------------------------------------------------------------- summary
def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _max(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return max(xs) if xs else None


def summarize(run, events: Sequence[dict], wall_s: float) -> dict:
    """``summary.json`` of a finished ``demo.run.DemoRun`` whose fleet wrote ``events``, ``wall_s`` after it began."""
    rows, final, cfg = run.rows, run.final, run.cfg
    log = log_numbers(events)
    fleet_cfg = run.fleet.config if run.fleet is not None else None
    violations = _violations(events, fleet_cfg)
    stopped = run.stopped or log["stopped"]
    complete = len(rows) == cfg.steps and bool(final)
    return {
        "ok": log["prompts_lost"] == 0 and not stopped and not run.error and not violations and complete,
        "steps": len(rows),
        "steps_planned": cfg.steps,
        **_learning(rows, final, run.task.chance_reward),
        "prompts_lost": log["prompts_lost"],
        "faults_injected": log["faults_injected"],
        "recoveries": log["recoveries"],
        "readmitted_by_peer": log["readmitted_by_peer"],
        "readmitted_before_next_refit": log["readmitted_before_next_refit"],
        "controller_restarts": log["controller_restarts"],
        "stale_samples_dropped": sum(int(r.get("dropped_stale", 0)) for r in rows),
        **continuation_figures(run.requests_end, run.continued),
        "results_returned": sum(int(r.get("returned", 0)) for r in rows) + int(final.get("returned", 0) or 0),
        "stopped": stopped,
        "error": run.error,
        "interrupted": run.interrupted,  # the signal that ended the run early (SIGINT, SIGTERM), or None
        "ray_gone": run.ray_gone,  # the local Ray's daemons that stopped with that signal
        "invariant_violations": violations,
        "wall_s": round(wall_s, 2),
        "fleet_start_s": round(run.fleet_start_s, 2) if run.fleet_start_s is not None else None,
        **_timings(rows, final),
        "kv_policy": cfg.kv_policy,
        "seed": cfg.seed,
        "fault_plan": {
            "name": run.plan.name if run.plan else "none",
            "source": str(cfg.fault_plan),
            "expect": run.plan.expect if run.plan else None,
            "description": run.plan.description if run.plan else "",
            "fired": run.fired,
        },
        "log": log,
        "final_eval": final,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "fleet": fleet_cfg.model_dump() if fleet_cfg is not None else run.fcfg,
        "fleet_end": run.status_end,
        "notes": run.notes,
        "metrics": rows,
        "files": {"summary": "summary.json", "events": "events.jsonl"},
        "rejoin": run.rejoin,
    }


def continuation_figures(counters: Mapping[str, Any] | None, continued: int) -> dict:
    """What continuation saved over the run: ``requests_continued`` (results that went on on another
    engine after theirs died mid-generation, counted by the driver from ``FleetResult.continued``),
    ``tokens_reused`` (tokens carried over from failed attempts into results: not generated again) and
    ``tokens_discarded`` (tokens received from failed attempts and thrown away because the request
    started over), both from the client's counters (``FleetClient.counters()``; None: never read)."""
    counters = counters or {}
    return {"requests_continued": int(continued), "tokens_reused": int(counters.get("tokens_reused", 0)),
            "tokens_discarded": int(counters.get("tokens_discarded", 0))}


def on_purpose_line(summary: Mapping[str, Any]) -> str | None:
    """The processes the fault plan killed on purpose, so that Ray's report of each death ("A worker died or was
    killed while executing a task by an unexpected system error ... SYSTEM_ERROR", printed where it happens)
    reads as what it is; None when the run killed nothing."""
    killed = []
    for f in summary.get("fault_plan", {}).get("fired", []):
        if f.get("what") == "kill" and f.get("slot") is not None:
            killed.append(f"slot {f['slot']}'s engine shard (step {f.get('step')})")
        elif f.get("what") == "kill_controller":
            pid = (f.get("controller") or {}).get("pid")
            killed.append(f"the controller{f' (pid {pid})' if pid is not None else ''} (step {f.get('step')})")
    if not killed:
        return None
    return ("killed on purpose by the fault plan: " + ", ".join(killed) + "; Ray reports each of these deaths as "
            "a worker that \"died or was killed ... by an unexpected system error\": that is this kill, not a crash")


def continuation_line(summary: Mapping[str, Any]) -> str | None:
    """The report's line on continuation (``continuation_figures``' numbers in ``summary``), when the run
    killed a shard or a request was continued or started over; None otherwise (nothing to say)."""
    fired = summary.get("fault_plan", {}).get("fired", [])
    killed = any(f.get("what") == "kill" and f.get("slot") is not None for f in fired)
    n, reused, discarded = summary["requests_continued"], summary["tokens_reused"], summary["tokens_discarded"]
    if not (killed or n or discarded):
        return None
    line = (f"continuation: {n} request{'' if n == 1 else 's'} continued after the shard kill, "
            f"{reused} token{'' if reused == 1 else 's'} reused (not generated again)")
    if discarded:
        line += f"; {discarded} token{'' if discarded == 1 else 's'} discarded (requests that started over)"
    elif not n:
        line += " (no request was mid-generation on the shard when it died)"
    return line


def _violations(events: Sequence[dict], fleet_cfg) -> list[str]:
    """Every broken invariant of the event log (deadlines from the fleet's config)."""
    if not events:
        return ["no event log was written"]
    deadline = fleet_cfg.lifecycle_deadline_s if fleet_cfg is not None else 0.0
    slack = (fleet_cfg.probe_timeout_s if fleet_cfg is not None else 5.0) + 2.0
    return invariants.check_all(events, deadline, slack_s=slack)


def _learning(rows: Sequence[dict], final: dict, chance: float) -> dict:
    """Reward at the start and the end of the run, and the train-vs-rollout logprob mismatch."""
    rewards = [r.get("reward_mean") for r in rows]
    k = max(1, min(5, len(rows) // 4))
    fresh = [r.get("audit_mismatch_max") for r in rows] + [final.get("audit_mismatch_max")]
    return {
        "reward_first": _mean(rewards[:k]),
        "reward_last": _mean(rewards[-k:]),
        "reward_window_steps": k,
        "reward_chance": chance,
        "reward_final_eval": final.get("reward_mean"),
        "max_logprob_mismatch": _max(fresh),
        "mean_logprob_mismatch": _mean([r.get("audit_mismatch_mean") for r in rows]),
        "max_logprob_mismatch_with_lag": _max([r.get("mismatch_max") for r in rows]),
        "trainer_fresh_mismatch_max": _max([r.get("fresh_mismatch_max") for r in rows]),
    }


def _timings(rows: Sequence[dict], final: dict) -> dict:
    """Step wall times (without a hold for restarts) and refit wall times as the driver saw them."""
    steps = [r["wall_s"] - r["held_s"] for r in rows]
    refits = [r["refit_s"] for r in rows if r.get("refit_s") is not None]
    if final.get("refit_s") is not None:
        refits.append(final["refit_s"])
    return {
        "step_s_p50": percentile(steps, 0.5),
        "step_s_max": _max(steps),
        "refit_s_p50": percentile(refits, 0.5),
        "refit_s_max": _max(refits),
        "refits": len(refits),
    }


def write_plots(out: Path, rows: Sequence[dict], events: Sequence[dict], summary: dict, final: dict, task) -> dict:
    """``learning.png`` (if a step ran) and ``timeline.png`` (if the fleet wrote a log) in ``out``; their names."""
    files = {}
    marks = []
    for f in summary["fault_plan"]["fired"]:
        what = "kill controller" if f["slot"] is None else f"{f['what']} slot {f['slot']}"
        marks.append((f["step"], what, "#a50f15"))
    for r in summary["log"]["readmissions"]:
        step = next((row["step"] for row in rows if row["t_end"] >= r["t"]), len(rows))
        marks.append((step, f"slot {r['slot']} back", "#00441b"))
    title = (f"rlfleet demo: {summary['steps']} steps, {summary['fleet']['num_engines']} engines, "
             f"plan {summary['fault_plan']['name']}, kv_policy {summary['kv_policy']}")
    if rows:
        files["learning"] = plot_learning(rows, out / "learning.png", chance=task.chance_reward, marks=marks,
                                          final=final, title=title).name
    if events:
        holds = [(*r["held"], "training held for the restart") for r in rows if r.get("held") and r["held_s"] >= 1.0]
        files["timeline"] = plot_timeline(events, out / "timeline.png", step_times=[r["t_begin"] for r in rows],
                                          holds=holds, title=title).name
    return files


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


def state_segments(events: Sequence[Mapping | Record], t_end: float) -> dict[int, list[tuple[float, float, str, int]]]:
    """Per slot: (t0, t1, state, incarnation) segments from the health events (a slot starts 'starting')."""
    events = all_of(events)
    t_first = events[0].t if events else 0.0
    current: dict[int, tuple[float, str, int]] = {}
    segs: dict[int, list[tuple[float, float, str, int]]] = {}
    for e in Health.among(events):
        t0, state, inc = current.get(e.slot, (t_first, "starting", e.incarnation))
        if e.t > t0:
            segs.setdefault(e.slot, []).append((t0, e.t, state, inc))
        current[e.slot] = (e.t, e.after, e.incarnation)
    for slot, (t0, state, inc) in current.items():
        segs.setdefault(slot, []).append((t0, max(t_end, t0), state, inc))
    return segs


def gate_segments(events: Sequence[Mapping | Record], t_end: float) -> list[tuple[float, float, bool]]:
    events = all_of(events)
    t_first = events[0].t if events else 0.0
    out, t0, is_open = [], t_first, False
    for g in Gate.among(events):
        if g.t > t0:
            out.append((t0, g.t, is_open))
        t0, is_open = g.t, bool(g.open)
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
    if not events:
        raise ValueError("no events to plot")
    events = all_of(events)
    t_end = events[-1].t
    opened = Gate.first(events, open=True)
    t_open = None if opened is None else opened.t
    startup_s = None
    if t0 is None:
        t0 = events[0].t
        if crop_startup and t_open is not None:
            startup_s, t0 = t_open - t0, t_open
    slots = sorted({h.slot for h in Health.among(events)})
    rows = {slot: i for i, slot in enumerate(slots)}
    fig, ax = plt.subplots(figsize=size, dpi=100)
    _draw_bars(ax, events, rows, t0, t_end)
    _draw_marks(ax, events, rows, t0, t_end)
    for ts in step_times:
        ax.axvline(ts - t0, color="#d9d9d9", lw=0.5, zorder=0)
    for a, b, label in holds:
        ax.axvspan(a - t0, b - t0, color="#fee391", alpha=0.35, lw=0, zorder=0)
        ax.text((a + b) / 2 - t0, len(slots) + 1, label, fontsize=7, ha="center", va="center", color="#8c510a")
    span = max(t_end - t0, 1.0)
    lead = min(startup_s, 0.04 * span) if startup_s is not None else 0.0
    ax.set_xlim(-lead, span * 1.01)
    steps_note = "; grey lines: training steps" if step_times else ""
    if startup_s is not None:
        ax.set_xlabel(f"seconds since the gate first opened (engines took {startup_s:.0f} s to start){steps_note}")
    else:
        ax.set_xlabel(f"seconds{steps_note}")
    _label_rows(ax, slots)
    return _save(fig, ax, title, path)


BAR_H = 0.7  # height of a timeline bar (rows are 1 apart)


def _draw_bars(ax, events: Sequence[dict], rows: dict[int, int], t0: float, t_end: float) -> None:
    """Per slot its states (with each incarnation's start labelled), then the gate, then the refit phases."""
    h = BAR_H
    for slot, segs in state_segments(events, t_end).items():
        y = rows[slot]
        ax.broken_barh([(a - t0, b - a) for a, b, _, _ in segs], (y - h / 2, h),
                       facecolors=[STATE_COLORS.get(s, "#ffffff") for _, _, s, _ in segs], edgecolor="none")
        last_inc = None
        for a, b, _, inc in segs:
            if inc != last_inc:
                ax.text(max(a - t0, 0.0), y + h / 2 + 0.02, f"inc {inc}", fontsize=6.5, va="bottom", ha="left", color="#444444")
                last_inc = inc
    gate_y, refit_y = len(rows), len(rows) + 1
    gates = gate_segments(events, t_end)
    ax.broken_barh([(a - t0, b - a) for a, b, _ in gates], (gate_y - h / 2, h),
                   facecolors=["#41ab5d" if o else "#969696" for _, _, o in gates], edgecolor="none")
    for span in refit_spans(events):
        if span["version"] is None:
            continue
        bars = [(a - t0, max(b - a, 0.15)) for _, a, b in span["phases"]]
        colors = [PHASE_COLORS.get(p, OTHER_PHASE_COLOR) for p, _, _ in span["phases"]]
        ax.broken_barh(bars, (refit_y - h / 2, h), facecolors=colors, edgecolor="none")


def _draw_marks(ax, events: Sequence[dict], rows: dict[int, int], t0: float, t_end: float) -> None:
    """On the slot rows: faults, kills, restarts (begin to end) and re-admissions."""
    gate_y = len(rows)
    for e in all_of(events):
        match e:
            case Fault(target="controller") if e.fired:
                ax.plot(e.t - t0, gate_y, "X", color="#a50f15", ms=11, mec="white", zorder=6)
                ax.text(e.t - t0, gate_y + 0.18, "controller killed", fontsize=7, color="#a50f15", ha="center",
                        va="bottom", zorder=6)
            case Fault() if e.slot in rows:
                ax.plot(e.t - t0, rows[e.slot], "x", color="#a50f15", ms=10, mew=2.5, zorder=5)
            case Kill() if e.slot in rows:
                ax.plot(e.t - t0, rows[e.slot] - 0.05, "v", color="black", ms=6, zorder=5)
    begins = {}
    for e in Restart.among(events, lambda r: r.slot in rows):
        key = (e.slot, e.incarnation)
        if e.edge == "begin":
            begins[key] = e.t
        elif key in begins:
            y = rows[e.slot] - BAR_H / 2 - 0.08
            ax.annotate("", xy=(e.t - t0, y), xytext=(begins[key] - t0, y),
                        arrowprops=dict(arrowstyle="|-|", color="#08519c", lw=1.2, mutation_scale=3))
            ax.text((begins[key] + e.t) / 2 - t0, y - 0.05, "restart", fontsize=7, color="#08519c",
                    ha="center", va="top")
    for r in readmissions(events):
        if r["slot"] in rows:
            ax.plot(r["t"] - t0, rows[r["slot"]], "*", color="#00441b", ms=14, mec="white", zorder=6)
            right = (r["t"] - t0) > 0.75 * max(t_end - t0, 1.0)
            ax.text(r["t"] - t0, rows[r["slot"]] + 0.05, f"re-admitted (v{r['version']}) ", fontsize=7,
                    color="#00441b", va="bottom", ha="right" if right else "left", zorder=6)


def _label_rows(ax, slots: Sequence[int]) -> None:
    """Row names (slots, gate, refit) and the colour legend under the axis."""
    from matplotlib.patches import Patch

    gate_y, refit_y = len(slots), len(slots) + 1
    ax.set_yticks([*range(len(slots)), gate_y, refit_y], [*(f"slot {s}" for s in slots), "gate", "refit"])
    ax.set_ylim(-0.8, refit_y + 0.6)
    legend = [Patch(color=STATE_COLORS[s], label="healthy / gate open" if s == "healthy" else s)
              for s in ("starting", "healthy", "stale", "dead", "restarting", "suspect")]
    legend += [Patch(color="#969696", label="gate closed")]
    legend += [Patch(color=PHASE_COLORS[p], label=f"refit: {p}") for p in ("pause", "transfer", "resume")]
    legend += [Patch(color=OTHER_PHASE_COLOR, label="refit: other")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              ncol=6, fontsize=7, frameon=False)
