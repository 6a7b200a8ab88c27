"""Live progress of ``rlfleet demo`` in the terminal: a ``rich`` panel on a TTY, plain lines otherwise.

Both views take the same calls from the demo loop:

- ``phase(text, minor)``: what the run is doing now (starting engines, refit, settling);
  ``minor`` phases (the parts of every step) are shown live but not logged as lines;
- ``note(text)``: something happened (a fault fired, a shard died, restarted, was re-admitted);
- ``step(row, status)``: one training step finished (its metrics and the fleet status after it);
- ``fleet(status)``: a fresh fleet status (the rich view polls it every second between steps).

The plain view writes one line per call, flushed, so CI logs show progress as it
happens. Neither view raises for a malformed status: progress display must never
break the run.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any, Callable, TextIO

STATE_STYLE = {
    "healthy": "bold green",
    "stale": "yellow",
    "starting": "dim",
    "restarting": "cyan",
    "suspect": "dark_orange",
    "hung": "magenta",
    "dead": "bold red",
    "retired": "white on red",
}


def _fmt(x: Any, spec: str = ".3f", missing: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    return format(x, spec)


def slots_of(status: dict | None) -> list[dict]:
    try:
        return list(status["ledger"]["slots"]) if status else []
    except (KeyError, TypeError):
        return []


def serving_of(status: dict | None) -> list[int]:
    return [s["slot"] for s in slots_of(status) if s.get("state") == "healthy"]


class PlainView:
    """One line per event, for logs and pipes."""

    def __init__(self, steps: int, stream: TextIO | None = None) -> None:
        self.steps = steps
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()

    def _say(self, text: str) -> None:
        print(f"[demo {time.monotonic() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)

    def start(self, info: dict) -> None:
        self._say(
            f"{info.get('engines')} engines, {self.steps} steps, fault plan {info.get('plan')}, "
            f"kv_policy {info.get('kv_policy')}, seed {info.get('seed')}, report -> {info.get('out')}"
        )

    def phase(self, text: str, minor: bool = False) -> None:
        if not minor:
            self._say(text)

    def note(self, text: str) -> None:
        self._say(f"* {text}")

    def fleet(self, status: dict) -> None:
        pass

    def step(self, row: dict, status: dict | None) -> None:
        states = " ".join(f"{s['slot']}:{s['state']}" for s in slots_of(status))
        gate = "open" if status and status.get("gate_open") else "closed"
        refit = f"{row['refit_s']:.2f}s" if row.get("refit_s") is not None else "-"
        self._say(
            f"step {row['step'] + 1:>3}/{self.steps} v{row.get('version')} "
            f"reward {_fmt(row.get('reward_mean'))} (max {_fmt(row.get('reward_max'), '.2f')}) "
            f"mismatch {_fmt(row.get('audit_mismatch_max'), '.1e')} "
            f"serving {len(serving_of(status))} [{states}] gate {gate} refit {refit} "
            f"dropped {row.get('dropped_stale', 0)} returned {row.get('returned', 0)} step {row['wall_s']:.1f}s"
        )

    def close(self) -> None:
        pass


class RichView:
    """A live panel: recent steps, each shard's state, the gate, the last refit, the notes."""

    def __init__(self, steps: int, poll: Callable[[], dict] | None = None, poll_every_s: float = 1.0) -> None:
        from rich.console import Console
        from rich.live import Live

        self.steps = steps
        self.console = Console()
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.status: dict | None = None
        self.info: dict = {}
        self.now = "starting"
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._live = Live(console=self.console, refresh_per_second=4, get_renderable=self._render, transient=False)
        self._poll, self._poll_every = poll, poll_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, info: dict) -> None:
        self.info = dict(info)
        self._live.start()

    def set_poll(self, poll: Callable[[], dict]) -> None:
        """Start polling the fleet status every ``poll_every_s`` (call once the fleet exists)."""
        self._poll = poll
        if self._thread is None:
            self._thread = threading.Thread(target=self._poller, name="rlfleet-demo-view", daemon=True)
            self._thread.start()

    def stop_polling(self) -> None:
        """Stop the status poller (before the fleet shuts down); the panel stays up until ``close``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _poller(self) -> None:
        while not self._stop.wait(self._poll_every):
            try:
                status = self._poll() if self._poll else None
            except Exception:  # noqa: BLE001 - the display must never break the run
                continue
            if status is not None:
                self.fleet(status)

    def phase(self, text: str, minor: bool = False) -> None:
        with self._lock:
            self.now = text

    def note(self, text: str) -> None:
        with self._lock:
            self.notes.append(f"[dim]{time.monotonic() - self.t0:6.1f}s[/dim] {text}")
            self.notes = self.notes[-6:]

    def fleet(self, status: dict) -> None:
        with self._lock:
            self.status = status

    def step(self, row: dict, status: dict | None) -> None:
        with self._lock:
            self.rows.append(row)
            if status is not None:
                self.status = status

    def _render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            rows, status, notes, now = list(self.rows[-12:]), self.status, list(self.notes), self.now
            done = len(self.rows)
            last_refit = next((r["refit_s"] for r in reversed(self.rows) if r.get("refit_s") is not None), None)
        head = Text.from_markup(
            f"[bold]rlfleet demo[/bold]  step {done}/{self.steps}  "
            f"{self.info.get('engines')} engines  plan [bold]{self.info.get('plan')}[/bold]  "
            f"kv_policy {self.info.get('kv_policy')}  {time.monotonic() - self.t0:.0f}s  [italic]{now}[/italic]"
        )
        fleet_line = Text()
        for s in slots_of(status):
            fleet_line.append(f" slot {s['slot']} ", style="bold")
            fleet_line.append(f"{s['state']}", style=STATE_STYLE.get(s["state"], ""))
            fleet_line.append(f" (inc {s['incarnation']}, v{s.get('weight_version')})  ")
        if status:
            gate = status.get("gate_open")
            fleet_line.append("gate ", style="bold")
            fleet_line.append("open" if gate else "closed", style="green" if gate else "red")
            fleet_line.append(f" on v{status.get('version')}")
        fleet_line.append(f"   last refit {_fmt(last_refit, '.2f')}s")
        table = Table(expand=False, pad_edge=False, box=None, header_style="bold")
        # Short headers so the table fits 80 columns: serving shards, refit seconds, stale samples dropped,
        # results returned, step seconds.
        for col in ("step", "v", "reward", "max", "mismatch", "srv", "gate", "refit", "drop", "ret", "sec"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(
                str(r["step"] + 1), str(r.get("version")), _fmt(r.get("reward_mean")), _fmt(r.get("reward_max"), ".2f"),
                _fmt(r.get("audit_mismatch_max"), ".1e"), str(len(r.get("serving", []))),
                "open" if r.get("gate_open") else "closed", _fmt(r.get("refit_s"), ".2f"),
                str(r.get("dropped_stale", 0)), str(r.get("returned", 0)), _fmt(r.get("wall_s"), ".1f"),
            )
        parts = [head, fleet_line, table]
        if notes:
            parts.append(Text.from_markup("\n".join(notes)))
        return Panel(Group(*parts), border_style="blue")

    def close(self) -> None:
        self.stop_polling()
        self._live.stop()


class QuietView(PlainView):
    def _say(self, text: str) -> None:
        pass


def make_view(mode: str, steps: int, stream: TextIO | None = None):
    """``auto`` picks rich on a TTY, plain lines otherwise; ``rich``, ``plain`` and ``off`` force one."""
    if mode not in ("auto", "rich", "plain", "off"):
        raise ValueError(f"progress must be auto, rich, plain or off, got {mode!r}")
    if mode == "off":
        return QuietView(steps, stream)
    if mode == "rich" or (mode == "auto" and (stream or sys.stdout).isatty()):
        try:
            return RichView(steps)
        except ImportError:
            pass
    return PlainView(steps, stream)
