"""``rlfleet demo``: train the GRPO recipe on a local fleet through a shard kill and a controller kill; write a report directory.

Exit status: 0 when the run finished every step with no prompt lost, the fleet never
stopped and every event-log invariant held; 1 otherwise; 2 for a bad flag or plan;
128 + the signal's number when SIGINT (130) or SIGTERM (143) ended the run early (the
report is written all the same). The last line on stdout is a one-line JSON digest of
``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DIGEST = (
    "ok", "steps", "reward_first", "reward_last", "reward_final_eval", "max_logprob_mismatch", "prompts_lost",
    "faults_injected", "recoveries", "readmitted_by_peer", "readmitted_before_next_refit", "requests_continued", "tokens_reused", "stale_samples_dropped", "stopped",
    "wall_s", "refit_s_p50", "refit_s_max", "interrupted",
)


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: GRPO on a fleet of vLLM engines through a shard kill and a controller kill; live progress and a report",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--engines", type=int, default=3, help="engine shards (default 3; quorum = engines - 1)")
    p.add_argument("--fault-plan", default="default",
                   help="'default' (kill slot 1 a third of the way in, the controller halfway), 'none', or a YAML fault plan path")
    p.add_argument("--kv-policy", default="recompute", choices=("recompute", "keep", "salt"))
    p.add_argument("--out", default="runs/demo", help="report directory (default ./runs/demo, git-ignored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory (default: the tiny model, built if missing)")
    p.add_argument("--rejoin-step", type=int, default=None,
                   help="the step whose refit first waits for restarts in progress, so a restarted shard rejoins "
                        "mid-run (default: 2/3 of the run when the plan has faults; -1: never hold training)")
    p.add_argument("--progress", default="auto", choices=("auto", "rich", "plain", "off"),
                   help="live view: rich on a terminal, plain lines otherwise (auto)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    # Ray holds a repeated message back (its log deduplication, a 5 s window) and prints what it held when it shuts
    # down: the controller's death that the default plan causes came out after "shutting down", where it read as a
    # crash of a run that succeeded. Unheld, each of Ray's worker-death reports prints where the kill happened, next
    # to the demo's own line for it. Read by Ray when it is imported: set before anything imports it.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from rlfleet.demo.report import continuation_line, on_purpose_line
    from rlfleet.demo.run import DemoConfig, _nan_to_none, run_demo
    from rlfleet.fleet.interrupt import exit_status

    cfg = DemoConfig(steps=args.steps, engines=args.engines, fault_plan=args.fault_plan, kv_policy=args.kv_policy,
                     out=args.out, seed=args.seed, model=args.model, progress=args.progress,
                     rejoin_step=args.rejoin_step)
    summary = run_demo(cfg)
    for problem in summary["invariant_violations"][:10]:
        print(f"invariant broken: {problem}")
    if summary.get("error"):
        print(f"error: {summary['error']}")
    if (line := continuation_line(summary)) is not None:
        print(line)
    if (line := on_purpose_line(summary)) is not None:
        print(line)
    from pathlib import Path

    files = ", ".join(f for f in summary["files"].values() if (Path(cfg.out) / f).exists())
    print(f"report: {cfg.out} ({files})")
    print(json.dumps(_nan_to_none({k: summary.get(k) for k in DIGEST}), default=str), flush=True)
    if summary.get("interrupted"):
        code = exit_status(summary["interrupted"])
        if summary.get("ray_gone"):  # nothing is left to stop; Ray's own exit would wait for its dead daemons
            sys.stderr.flush()
            os._exit(code)
        return code
    return 0 if summary["ok"] else 1
