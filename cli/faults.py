"""``rlfleet faults run``: run one fault plan or the whole matrix on a local Ray with real engines.

Prints one row per variant (expected vs observed outcome, the faults that went off
as slot/incarnation point:action (point:action for a trainer's fault), seconds from each firing to the gate reopening,
prompts accepted/completed/returned/lost, wrong version tags) and, last, one JSON
object with ``variants``, ``passed``, ``prompts_lost``, ``wrong_version_tags``,
``failed`` and ``per_variant`` (each variant's verdict, fault -> reopen seconds and
the faults it fired). Exits non-zero if any variant failed; 130 or 143 when Ctrl-C or a SIGTERM
ended the run early (the variants that finished are reported, ``interrupted`` names the signal,
the fleet is shut down and nothing is left running).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def register(sub) -> None:
    faults = sub.add_parser("faults", help="fault injection: run plans or the fault matrix").add_subparsers(
        dest="faults_command", required=True
    )
    run = faults.add_parser("run", help="run a fault plan (YAML) or the matrix against a short async loop")
    what = run.add_mutually_exclusive_group(required=True)
    what.add_argument("--matrix", action="store_true", help="run every matrix variant")
    what.add_argument("--plan", type=Path, help="a YAML fault plan")
    run.add_argument("--only", nargs="*", help="with --matrix: only these variants")
    run.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    run.add_argument("--json-out", type=Path, help="also write the rows as JSON to this file")
    run.set_defaults(func=_cmd_run)


FAULT_KEYS = ("slot", "incarnation", "point", "action", "fault_to_reopen_s")


def _fault_cells(r: dict) -> dict:
    """The table's cells for the faults a row fired: ``s1/i1 step_boundary:kill`` (``update:corrupt_shape`` for a
    trainer's fault) and each one's fault -> reopen."""
    faults = r.get("faults") or []
    fired = ", ".join(("" if f["slot"] is None else f"s{f['slot']}/i{f['incarnation']} ") + f"{f['point']}:{f['action']}"
                      for f in faults)
    reopen = [r["fault_to_reopen_s"]] if not faults else [f["fault_to_reopen_s"] for f in faults]
    return {"fired": fired or "none", "fault_to_reopen_s": " / ".join("-" if s is None else str(s) for s in reopen)}


def _table(rows: list[dict]) -> str:
    cols = ["variant", "expected", "observed", "fired", "fault_to_reopen_s", "accepted", "completed", "returned",
            "lost", "wrong_version_tags", "passed"]
    head = ["variant", "expected", "observed", "fault fired (slot/inc point:action)", "fault->reopen s", "accepted",
            "completed", "returned", "lost", "wrong tags", "result"]
    cells = [[("PASS" if r[c] else "FAIL") if c == "passed" else ("-" if r[c] is None else str(r[c])) for c in cols]
             for r in ({**r, **_fault_cells(r)} for r in rows)]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(head)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(c) for c in cells])


def _cmd_run(args: argparse.Namespace) -> int:
    from rlfleet.fleet.cluster import ray_door
    from rlfleet.faults.matrix import Variant, by_name
    from rlfleet.faults.runner import run_variants
    from rlfleet.recipe.tinymodel import build_model, default_model_dir
    import yaml

    from rlfleet.fleet.interrupt import catch_signals, exit_status, interrupted_by, restore
    from rlfleet.health.faultplan import load_plan

    try:
        if args.plan:
            try:
                text = args.plan.read_text()
            except OSError as exc:
                raise ValueError(f"cannot read the plan: {exc.strerror or exc}") from None
            plan = load_plan(text)  # validates, naming the field at fault
            variants = [Variant(dict(yaml.safe_load(text)))]
            print(f"[faults] plan {plan.name}: {len(plan.faults)} fault(s), expect {plan.expect}")
        else:
            variants = by_name(args.only)
    except ValueError as exc:  # a plan or variant name the user got wrong: one line, nothing started
        print(f"rlfleet: error: {args.plan or '--only'}: {exc}", file=sys.stderr)
        return 2
    model = args.model or str(build_model(default_model_dir("tiny")))
    reports: list = []
    interrupted, ray_gone = None, False
    handlers = catch_signals(fresh=True)
    try:
        try:
            ray_door.init_local(log_to_driver=False)
            catch_signals()  # Ray's start-up replaced the SIGTERM handler
            reports = run_variants(model, variants, log=lambda m: print(m, flush=True), done=reports)
        except KeyboardInterrupt:
            interrupted = interrupted_by() or "SIGINT"
            print(f"[faults] interrupted by {interrupted}: {len(reports)} of {len(variants)} variant(s) finished; "
                  "the variant running was not judged, its fleet is shut down", flush=True)
        finally:
            ray_gone = bool(interrupted and ray_door.local_ray_down())
            if not ray_gone:  # else nothing is left to stop: Ray went down with the signal
                ray_door.shutdown()
    finally:
        restore(handlers)
    if interrupted:
        interrupted = interrupted_by() or interrupted  # every signal that came with the first one is in by now
    rows = [r.row() for r in reports]
    print(_table(rows))
    for r in rows:
        for problem in r["violations"] + r["notes"]:
            print(f"  {r['variant']}: {problem}")
    summary = {
        "interrupted": interrupted,
        "variants": len(rows),
        "passed": sum(r["passed"] for r in rows),
        "prompts_lost": sum(r["lost"] for r in rows),
        "wrong_version_tags": sum(r["wrong_version_tags"] for r in rows),
        "failed": [r["variant"] for r in rows if not r["passed"]],
        "per_variant": {
            r["variant"]: {"passed": r["passed"], "fault_to_reopen_s": r["fault_to_reopen_s"],
                           "faults": [{k: f[k] for k in FAULT_KEYS} for f in r.get("faults", [])]}
            for r in rows
        },
    }
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    print(json.dumps(summary), flush=True)
    if interrupted:
        if ray_gone:  # Ray's own exit would wait for its dead daemons
            sys.stderr.flush()
            os._exit(exit_status(interrupted))
        return exit_status(interrupted)
    return 0 if summary["passed"] == summary["variants"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="rlfleet")
    register(p.add_subparsers(dest="command", required=True))
    a = p.parse_args()
    sys.exit(a.func(a))
