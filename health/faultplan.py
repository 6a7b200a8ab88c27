"""Declarative fault plans: where, what, which shard and when, validated and resolved deterministically.

A plan is plain data (a dict or YAML text) so users can write campaigns without
code::

    name: kill-during-transfer
    expect: recovers            # or: stops (with the gate closed)
    steps: 3                    # refits in the short async loop
    seed: 7                     # resolves shard: random
    fleet: {restart_budget: 2}  # overrides of the fleet config for this plan
    faults:
      - {where: transfer, what: kill, shard: 1, step: 2}

``where``: ``step_boundary`` (before the step's refit), ``pause``, ``transfer``,
``stamp`` (the version stamp, ``set_weight_version``; ``unavailable`` only), ``resume``, ``generate``,
``stream`` (mid-generation: as a streamed request sends a chunk of output; with ``after_calls`` the
fault acts at a later chunk, while clients hold part of their output; ``kill`` and ``crash_engine`` only),
``donate`` (a donor's side of a peer copy, as its ``donate_weights`` begins: the receiver is already waiting in
its receive; the copies of re-admission, ``fleet.control.readmission``). ``what``: ``kill`` (the actor process), ``freeze`` (stops
answering), ``hang`` (one lifecycle call past its deadline), ``false_ack``,
``unavailable`` (one lifecycle call answers "unavailable"), ``slow`` (every call by
``delay_s``), ``delay`` (one call held ``delay_s``, then it goes on: a copy that lasts long enough to act in
its middle), ``crash_engine`` (the engine core inside a live actor), ``freeze_core`` (the
engine core stopped, SIGSTOP, under a live actor that keeps answering). ``shard``: a slot
number or ``random`` (drawn with the plan's seed). ``step``: the step it fires at;
``every``: fire again every that many steps, ``times`` times in all (repeated kills of
one slot). ``after_calls`` (a fault armed at one of the shard's hook points: ``pause``, ``transfer``,
``resume``, ``generate``, ``donate``, ``stamp``, ``stream``): let that many calls there pass, and act at the next one
(at ``stream``, a count of chunks: a kill after the shard streamed that much output, however fast its
engine runs, where a ``delay_s`` races the end of the batch).

``between_refits`` (``kill``, ``freeze`` or ``freeze_core``): killed at the step boundary, or frozen at
its next request (so one is in flight on it), and the step's refit waits until the
controller found it on its own (dead, or frozen and evicted) and the slot is back up
(kill two to take the fleet below quorum between refits, with requests waiting).

Faults of the fleet's controller name no ``shard`` either: ``what: kill_controller``
SIGKILLs the controller's process (Ray restarts it; the new one re-adopts the shards):

- ``where: between_refits``: from outside (``os.kill`` on its pid) while the step's
  requests are in flight, then the step's refit (re-sent once it answers again);
- ``where`` a refit phase (``close``, ``staleness``, ``reconcile``, ``pause``,
  ``transfer``, ``stamp``, ``resume``, ``reopen``): the controller kills itself as the
  step's refit reaches that phase, or ``delay_s`` after (only if the phase still runs:
  with a ``slow`` shard, the transfer's calls are in flight);
- ``where: shutdown``: it kills itself half way through the fleet's shutdown (the
  driver shuts the fleet down after the plan's last step).

Faults of the trainer's refit call itself name no ``shard``:

- ``where: update``, ``what: corrupt_shape | corrupt_dtype | corrupt_missing_tensor |
  corrupt_missing_layer``: the step's update carries a tensor of the wrong shape or
  dtype, or leaves out one tensor or its whole decoder layer; that refit must be
  refused naming the tensor, the fleet serving on; the next (correct) one commits;
- ``where: update``, ``what: kill_sender``: the trainer's weight-sender process dies as
  its send of the step's update begins (the engines paused and waiting for the bytes);
  that refit must roll back (``RefitSourceFailed`` naming the sender), the fleet serving
  on; the next refit, from a new sender, commits;
- ``where: call``, ``what: stale_version`` (a refit whose version is not greater than
  the committed one, while requests are in flight: refused, nothing changes),
  ``concurrent_refit`` (two refits at once from two threads: they must not overlap) or
  ``refit_under_load`` (a refit while 4 client threads submit without pause and a lagging
  client sends work routed under the pre-refit state: nothing lost, nothing served on
  the wrong weights, and every lagging request refused by the shards), or
  ``resize_under_load`` (client threads submit without pause while the fleet grows by
  one engine, a refit lands, and it shrinks by one: the new engine serves after the
  refit, the removed one is drained and retired, nothing lost), or ``poison_request``
  (every engine armed to crash under one prompt, which is then sent twice: at most two
  engines die, it comes back as ``poison`` and is refused at once the second time; the
  fleet keeps serving), or ``poison_in_batch`` (the same prompt in a batch of 24 on three engines: every
  innocent request completes, the poison comes back ``poison`` after at most two engines), or
  ``operator_resume_mid_refit`` (the operator's ``keep`` pause, a refit, and the
  operator's resume sent while its transfer runs: the engines refuse it and sample nothing until the refit
  resumes them), or ``controller_kill_under_keep_pause`` (the controller killed while a ``keep`` pause holds
  requests: the engines stay paused across its restart until the operator's resume), or
  ``loop_error_then_kill`` (ticks of the controller's liveness monitor raise, then an idle engine is killed:
  the monitor, still running, finds it within the hang-detection bound), or ``admission_hold_across_refit``
  (a refit held paused, with requests on its engines, past the admission law's ``absent_fallback_s``: every
  shard's admission cap after it is its cap before), or a stale engine's re-admission from a live peer
  (``faults.readmit``) meeting a fault in the middle of its copy: ``readmit_donor_killed`` (the donor dies as
  it begins to send: another donor gives the weights), ``readmit_engine_killed`` (the stale engine dies: a
  normal restart, and its next incarnation is re-admitted), ``readmit_refit_mid_copy`` (the trainer's refit
  begins: the copy yields, the refit takes the engine by its state) or ``readmit_controller_killed`` (the
  controller is SIGKILLed: its successor finds the engine stale and re-admits it).

Pure: no Ray, no vLLM. ``load_plan`` raises ``ValueError`` naming the field
(``faults[0].where``) and the allowed values; ``resolve`` turns a plan into
concrete (step, where, what, slot, delay) firings, the same ones for the same seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, cast

HOOKED = ("pause", "transfer", "resume", "generate", "donate")  # the shard's hook points a plan can name
# ``stamp``: inside the refit's last call to an engine (``end_refit``), before its resume: a stamp that fails there
# is reported by the engine, which still resumes (``unavailable``, ``error`` or ``false_ack``)
# ``stream``: mid-generation, as a streamed request sends a chunk of output (a death there, or ``delay_s`` after,
# leaves clients holding part of their output: what continuation carries on; ``fleet.shard.fault_hooks``)
SHARD_WHERE = ("step_boundary", "between_refits") + HOOKED + ("stamp", "stream")
COUNTED = HOOKED + ("stamp", "stream")  # where a fault is armed on the shard and can let calls pass (``after_calls``)
TRAINER_WHERE = ("update", "call")  # faults of the trainer's refit call, not of a shard
# The refit's phases (``fleet.control.lifecycle``) and the shutdown: where the controller can crash itself. An engine
# costs three control calls a refit: ``pause`` (fence, abort the too old, pause), ``transfer``, ``resume``
# (stamp, abort what an unstamped engine held, resume); ``commit`` is the controller's own (intent and ledger).
REFIT_PHASES = ("close", "reconcile", "pause", "transfer", "commit", "resume", "reopen")
CONTROLLER_WHERE = ("between_refits", "stage") + REFIT_PHASES + ("shutdown",)  # stage: a refit's step 0 (stage_ahead)
CONTROLLER_WHAT = ("kill_controller",)  # faults of the fleet's controller, not of a shard
WHERE = SHARD_WHERE + TRAINER_WHERE + tuple(w for w in CONTROLLER_WHERE if w not in SHARD_WHERE)
MAX_CRASH_DELAY_S = 600.0  # the controller refuses a crash delayed this long or longer
CORRUPTIONS = ("shape", "dtype", "missing_tensor", "missing_layer")  # ``faults.source.WeightSource`` kinds
# A fault in the middle of a re-admission's peer copy (``faults.readmit``): a scenario the driver runs as one call
READMIT_FAULTS = ("readmit_donor_killed", "readmit_engine_killed", "readmit_refit_mid_copy", "readmit_controller_killed")
_ANYWHERE = ("step_boundary",) + HOOKED
# What is possible where: a lie needs a call that acknowledges; a hang needs a call with a deadline;
# a trainer's fault happens in its own refit call.
ALLOWED: dict[str, tuple[str, ...]] = {
    "kill": ("step_boundary", "between_refits") + HOOKED + ("stream",),
    "freeze": _ANYWHERE + ("between_refits",),
    "freeze_core": _ANYWHERE + ("between_refits",),
    "hang": ("pause", "transfer", "resume"),
    "false_ack": ("pause", "stamp", "resume"),
    "unavailable": ("pause", "stamp", "resume"),
    "error": ("stamp",),
    "slow": _ANYWHERE,
    "delay": HOOKED + ("stamp",),
    "crash_engine": _ANYWHERE + ("stream",),
    **{f"corrupt_{kind}": ("update",) for kind in CORRUPTIONS},
    "kill_sender": ("update",),
    "stale_version": ("call",),
    "concurrent_refit": ("call",),
    "refit_under_load": ("call",),
    "resize_under_load": ("call",),
    "poison_request": ("call",),
    "poison_in_batch": ("call",),
    "operator_resume_mid_refit": ("call",),
    "controller_kill_under_keep_pause": ("call",),
    "loop_error_then_kill": ("call",),
    "relay_commit_lost": ("call",),
    "admission_hold_across_refit": ("call",),
    **{name: ("call",) for name in READMIT_FAULTS},
    "kill_controller": CONTROLLER_WHERE,
}
WHAT = tuple(ALLOWED)
EXPECT = ("recovers", "stops")


@dataclass(frozen=True)
class FaultSpec:
    where: str
    what: str
    shard: int | Literal["random"] | None  # None: a trainer's fault (``TRAINER_WHERE``) or the controller's (``CONTROLLER_WHAT``)
    step: int = 1
    delay_s: float = 0.0
    every: int = 0
    times: int = 1
    after_calls: int = 0


@dataclass(frozen=True)
class FaultPlan:
    name: str
    expect: str
    faults: tuple[FaultSpec, ...]
    steps: int = 3
    seed: int = 0
    fleet: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class Firing:
    """One concrete fault: at ``step``, at ``where``, do ``what`` to ``slot`` (None: to the trainer's refit
    or, ``kill_controller``, to the fleet's controller)."""

    step: int
    where: str
    what: str
    slot: int | None
    delay_s: float = 0.0
    after_calls: int = 0  # calls at its hook point that go by before it acts


def _need(cond: bool, field_name: str, problem: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"fault plan {field_name}: {problem} (got {value!r})")


def _int(d: Mapping, key: str, default: int, where: str, minimum: int) -> int:
    v = d.get(key, default)
    _need(type(v) is int and v >= minimum, f"{where}.{key}", f"must be an integer >= {minimum}", v)
    return v


def _fault(d: Any, i: int, steps: int) -> FaultSpec:
    at = f"faults[{i}]"
    _need(isinstance(d, Mapping), at, "must be a mapping", d)
    unknown = set(d) - {"where", "what", "shard", "step", "delay_s", "every", "times", "after_calls"}
    _need(not unknown, at, f"unknown keys {sorted(unknown)}", d)
    where, what = d.get("where"), d.get("what")
    _need(where in WHERE, f"{at}.where", f"must be one of {WHERE}", where)
    _need(what in WHAT, f"{at}.what", f"must be one of {WHAT}", what)
    _need(where in ALLOWED[what], f"{at}.where", f"{what} is only possible at {ALLOWED[what]}", where)
    if where in TRAINER_WHERE:
        _need("shard" not in d, f"{at}.shard", f"a fault at {where} acts on the trainer's refit call, not on a "
              "shard: leave shard out", d.get("shard"))
        shard = None
    elif what in CONTROLLER_WHAT:
        _need("shard" not in d, f"{at}.shard", f"{what} acts on the fleet's controller, not on a shard: "
              "leave shard out", d.get("shard"))
        shard = None
    else:
        shard = d.get("shard", "random")
        _need(shard == "random" or (type(shard) is int and shard >= 0), f"{at}.shard", "must be a slot >= 0 or 'random'", shard)
    step = _int(d, "step", 1, at, 1)
    _need(step <= steps, f"{at}.step", f"must be within the plan's {steps} steps", step)
    delay = d.get("delay_s", 0.0)
    _need(isinstance(delay, (int, float)) and not isinstance(delay, bool) and delay >= 0, f"{at}.delay_s", "must be >= 0", delay)
    if what in CONTROLLER_WHAT:
        _need(delay == 0 or where in REFIT_PHASES, f"{at}.delay_s", f"only a {what} at a refit phase "
              f"{REFIT_PHASES} can be delayed (it fires if that phase still runs), not one at {where}", delay)
        _need(delay < MAX_CRASH_DELAY_S, f"{at}.delay_s", f"must be below {MAX_CRASH_DELAY_S:.0f} s", delay)
    every, times = _int(d, "every", 0, at, 0), _int(d, "times", 1, at, 1)
    _need(times == 1 or every >= 1, f"{at}.every", "must be >= 1 when times > 1", every)
    after = _int(d, "after_calls", 0, at, 0)
    _need(what != "delay" or delay > 0, f"{at}.delay_s", "a delay holds its one call for delay_s: give it > 0", delay)
    _need(after == 0 or what != "slow", f"{at}.after_calls", "a slow shard slows every call from the moment "
          "it is armed: there are no calls to let pass", after)
    _need(after == 0 or (shard is not None and where in COUNTED), f"{at}.after_calls", f"counts the calls at "
          f"a shard's hook point {COUNTED} before the fault acts; a {what} at {where} is not armed there", after)
    return FaultSpec(where, what, shard, step, float(delay), every, times, after)


def load_plan(data: Mapping[str, Any] | str) -> FaultPlan:
    """Validate a plan from a mapping or YAML text."""
    if isinstance(data, str):
        import yaml

        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:  # a typo in a plan file is the user's to fix: say where, as a ValueError
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"fault plan: not valid YAML{at}: {problem}") from None
    _need(isinstance(data, Mapping), "<root>", "must be a mapping", data)
    data = cast(Mapping[str, Any], data)  # _need raised otherwise
    unknown = set(data) - {"name", "expect", "faults", "steps", "seed", "fleet", "description"}
    _need(not unknown, "<root>", f"unknown keys {sorted(unknown)}", sorted(unknown))
    name = data.get("name")
    _need(isinstance(name, str) and name != "", "name", "must be a non-empty string", name)
    expect = data.get("expect")
    _need(expect in EXPECT, "expect", f"must be one of {EXPECT}", expect)
    steps = _int(data, "steps", 3, "<root>", 1)
    seed = _int(data, "seed", 0, "<root>", 0)
    fleet = data.get("fleet", {}) or {}
    _need(isinstance(fleet, Mapping), "fleet", "must be a mapping of fleet config overrides", fleet)
    faults = data.get("faults", ())
    _need(isinstance(faults, (list, tuple)), "faults", "must be a list", faults)
    specs = tuple(_fault(f, i, steps) for i, f in enumerate(faults))
    # name and expect: strings, as _need checked above
    return FaultPlan(cast(str, name), cast(str, expect), specs, steps, seed, dict(fleet), str(data.get("description", "")))


def resolve(plan: FaultPlan, num_engines: int) -> list[Firing]:
    """Concrete firings, sorted by step; ``random`` shards drawn from ``plan.seed``. Slots must exist."""
    rng = random.Random(plan.seed)
    out = []
    for i, f in enumerate(plan.faults):
        slot = rng.randrange(num_engines) if f.shard == "random" else f.shard
        _need(slot is None or slot < num_engines, f"faults[{i}].shard", f"must be below the fleet's {num_engines} engines", slot)
        for k in range(f.times):
            step = f.step + k * f.every
            if step <= plan.steps:
                out.append(Firing(step, f.where, f.what, slot, f.delay_s, f.after_calls))
    return sorted(out, key=lambda x: (x.step, -1 if x.slot is None else x.slot))
