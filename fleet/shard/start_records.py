"""Engine start records: one JSON line per engine a shard built, for whoever counts cold starts.

When ``RLFLEET_START_RECORDS`` names a file, every ``EngineShard.start`` that built its engine
appends one line to it: slot, incarnation, backend, seconds the start took, process id, and
whether it succeeded. The test suite sets it for the whole session (every Ray worker and every
CLI process it starts inherits the variable) and prints the count at the end of the run, so the
engine cold starts a change adds are seen, not guessed. Unset (the default), nothing is written.

A failure to write is never the shard's failure: the record is dropped, the start goes on.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

ENV = "RLFLEET_START_RECORDS"


def record_start(slot: int, incarnation: int, backend: str, seconds: float, ok: bool) -> None:
    """Append this start's record to the file ``RLFLEET_START_RECORDS`` names (nothing when unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"t": time.time(), "slot": slot, "incarnation": incarnation, "backend": backend,
                       "start_s": round(seconds, 3), "ok": ok, "pid": os.getpid()})
    try:
        with open(path, "a", encoding="utf-8") as f:  # one short line per write: appends do not interleave
            f.write(line + "\n")
    except OSError:
        pass


def read_starts(path: str | Path) -> list[dict]:
    """The records in ``path`` (none when it does not exist); a torn last line is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def summarize(records: list[dict]) -> str:
    """One line: starts by backend, failed ones apart, and the engine seconds they cost."""
    ok = Counter(r["backend"] for r in records if r.get("ok"))
    failed = sum(1 for r in records if not r.get("ok"))
    seconds = sum(float(r.get("start_s", 0.0)) for r in records if r.get("backend") == "vllm")
    parts = ", ".join(f"{n} {b}" for b, n in sorted(ok.items())) or "none"
    return f"engine starts: {parts}; {failed} failed; vllm engine start time {seconds:.0f} s in all"


def by_window(records: list[dict], windows: list[tuple[float, str]]) -> list[tuple[str, str]]:
    """``summarize`` per owner: each record is charged to the owner of the last window that began before
    its engine started (``windows``: (wall time, owner) in time order). Owners in first-seen order, those
    with no record left out."""
    import bisect

    starts = [t for t, _ in windows]
    mine: dict[str, list[dict]] = {}
    for r in records:
        began = float(r.get("t", 0.0)) - float(r.get("start_s", 0.0))
        i = bisect.bisect_right(starts, began) - 1
        mine.setdefault(windows[i][1] if i >= 0 else "(before the first test)", []).append(r)
    return [(owner, summarize(rs)) for owner, rs in mine.items()]
