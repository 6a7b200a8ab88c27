"""The fault matrix: every failure class of DESIGN.md as a plan with its expected outcome.

Each variant is a plan (``health.faultplan`` format) plus the extra checks that
prove its point beyond "recovered" or "stopped": a frozen shard must be evicted (not
merely skipped), a killed shard must come back and serve, a slot killed past its
restart budget must be retired, a stop must name the slot that caused it, requests
must wait while the fleet is below quorum between refits, a warm spare must take a
killed serving engine's place before its restart ends. The trainer's own faults
(a bad update, a stale version, two refits at once, its weight sender killed mid-refit)
must change nothing but their refit. The controller's death (killed from outside between refits, or crashing itself
in a refit phase or half way through the shutdown) must cost nothing: Ray restarts it,
it re-adopts the shards, the step's refit (re-sent) lands, the fleet serves one
committed version, and a shutdown it died in is finished with no shard left behind. A stale engine's
re-admission from a live peer must survive a fault in the middle of its copy (its donor's death, its own, the
trainer's refit, the controller's death) with no version burned (``faults.readmit``).
"""

from __future__ import annotations

from dataclasses import dataclass

# The fleet every variant runs on unless its plan overrides a field.
BASE_FLEET = {
    "num_engines": 3,
    "min_healthy_engines": 2,
    "refit_timeout_s": 10.0,
    "lifecycle_grace_s": 5.0,
    "probe_timeout_s": 3.0,
    "suspect_timeout_s": 8.0,
    "stall_timeout_s": 10.0,  # an engine holding work with no token for this long is hung (the default is 30 s)
    "unhealthy_threshold": 2,
    "restart_backoff_s": 0.5,
    "restart_backoff_cap_s": 2.0,
    # Every recovering variant with this fleet shares one fleet, so its slots spend restarts variant after
    # variant (at most 5 on one slot): each keeps enough to come back.
    "restart_budget": 8,
    "controller_max_restarts": 10,  # the controller variants kill it 5 times, 4 on one fleet
}
# The controller crashes this long into the transfer, while one shard's transfer is held back longer (``slow``):
# the transfer's calls are in flight when it dies. ``slow`` delays every call of that shard until the runner
# undoes it after the step's refit: below ``probe_timeout_s`` (3 s), so its health probes still answer.
SLOW_TRANSFER_S, CRASH_IN_TRANSFER_S = 2.0, 0.75
# A variant that stops, or spends a slot's whole restart budget, gets a fleet of its own: two engines are enough
# to show it (one faulted, one that must not be blamed).
PAIR = {"num_engines": 2}
# Variants that test the controller's decisions only (a refit that must stop, requests held below quorum, a
# failed stamp, a slot retired past its budget, a spare promoted, a resize under load, a pause or resume that
# never returns and the eviction that ends it) run on shards with no
# vLLM engine: real Ray actors (a kill ends a real process), the real controller, clients, transport and
# weight bytes (``null_receives_weights``), each request in flight for ``null_generate_s``; an engine starts
# in about a second instead of 15-25 s (``null_start_s`` where the point is what happens while one starts).
# Their deadlines are sized for the test: a hang is waited out for 3 + 1.5 s, not 10 + 5. Kills of real
# engine processes, freezes, engine-core crashes and the weights inside vLLM stay on real engines (every
# variant without ``NULL``).
NULL_ENGINE = {"backend": "null", "null_receives_weights": True, "null_generate_s": 0.3, "num_cpus": 0}
NULL = {"engine": NULL_ENGINE, "refit_timeout_s": 3.0, "lifecycle_grace_s": 1.5, "probe_timeout_s": 1.5,
        "suspect_timeout_s": 4.0}
# Staging ahead on shards with no engine: the update's bytes move into staging areas while the fleet serves.
STAGING = {**NULL, "stage_ahead": True}
# Quorum of one on three engines: a poison prompt takes two down and the third serves on; a stamp that fails
# on one engine leaves the other two serving.
ONE_OF_THREE = {"min_healthy_engines": 1}
# A refit held paused past the admission law's absence bound (issue 47), in seconds rather than the 40 s of a
# long transfer: stats count as missing after 1 s without a record and fall back after 5 s more (not less: a
# real engine's first steps may take seconds); one engine's calls each take ``faults.admission_hold.SLOW_S``
# (4 s) longer, which keeps the other paused 8 s or more (18 s on a two-core host), and its probes get 6 s.
ADMISSION_HOLD = {**PAIR, "min_healthy_engines": 1, "probe_timeout_s": 6.0,
                  "admission": {"stats_max_age_s": 1.0, "absent_fallback_s": 5.0, "poll_interval_s": 0.25}}


@dataclass(frozen=True)
class Variant:
    plan: dict
    # "evicted:<slot>", "readmitted:<slot>", "restamped:<slot>", "retired:<slot>", "stop_names:<slot>",
    # "delta_sent" (a transfer went as patches), "delta_refused:<slot>" (that engine refused them, sent whole),
    # "below_quorum", "controller_back", "promoted:<slot>", "resent:<slot>" (faults.runner)
    checks: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.plan["name"]


def _v(name, expect, faults, checks=(), steps=2, fleet=None, description=""):
    plan = {"name": name, "expect": expect, "steps": steps, "faults": faults, "description": description}
    if fleet:
        plan["fleet"] = fleet
    return Variant(plan, tuple(checks))


MATRIX: tuple[Variant, ...] = (
    _v("kill-step-boundary", "recovers", [{"where": "step_boundary", "what": "kill", "shard": 1, "step": 1}],
       description="a shard's actor process killed between steps"),
    _v("kill-during-pause", "recovers", [{"where": "pause", "what": "kill", "shard": 2, "step": 1}]),
    _v("kill-during-transfer", "recovers", [{"where": "transfer", "what": "kill", "shard": 0, "step": 2}],
       checks=("delta_sent",), description="a real engine killed while the update's patches reach it (refit.delta): "
                                           "step 1's refit leaves every engine on the trainer's base"),
    _v("kill-during-resume", "recovers", [{"where": "resume", "what": "kill", "shard": 1, "step": 1}]),
    # the RL surface's commit where the controller dies after it (issue 47): real engines, whose applied digests
    # /weight_checker reads (``verify_weights: checksum``)
    _v("relay-commit-under-controller-kill", "recovers", [{"where": "call", "what": "relay_commit_lost", "step": 1}],
       steps=1, fleet={**PAIR, "verify_weights": "checksum"},
       description="a trainer's update through vLLM's RL API whose refit commits as the controller is killed; the "
                   "surface's call gives up waiting for the restart: it answers 503 and keeps the update, the "
                   "re-sent finish learns from the restarted controller that it committed, /weight_checker finds "
                   "every engine on the relay's weights, and the next (partial) update builds on them"),
    _v("stamp-error", "recovers", [{"where": "stamp", "what": "error", "shard": 2, "step": 1}],
       checks=("restamped:2",),
       description="set_weight_version raises on one real engine after the commit: that engine alone is stale "
                   "(version unknown, out of routing), the gate reopens on the other two, and it is stamped again "
                   "(re-admitted from a live peer, or by the next refit) and serves again; the fleet never stops"),
    _v("engine-core-crash", "recovers", [{"where": "generate", "what": "crash_engine", "shard": 2, "step": 1}],
       description="the vLLM engine core dies inside a live shard actor"),
    _v("freeze-during-transfer", "recovers", [{"where": "transfer", "what": "freeze", "shard": 0, "step": 1}],
       checks=("evicted:0",), description="a frozen shard is left out of the retry, then evicted, not waited on"),
    _v("restart-readmission", "recovers", [{"where": "step_boundary", "what": "kill", "shard": 1, "step": 1}],
       checks=("readmitted:1",),
       description="the killed shard restarts and serves again (re-admitted from a live peer at the committed "
                   "version, a real vLLM copy, or by the next refit)"),
    _v("bad-update-wrong-shape", "recovers", [{"where": "update", "what": "corrupt_shape", "step": 1}], steps=1,
       description="an update with a tensor of the wrong shape is refused naming it; the next update commits"),
    _v("bad-update-missing-layer", "recovers", [{"where": "update", "what": "corrupt_missing_layer", "step": 1}],
       steps=1, description="an update without one decoder layer is refused naming it; the next update commits"),
    _v("sender-killed-mid-transfer", "recovers", [{"where": "update", "what": "kill_sender", "step": 1}], steps=1,
       description="the trainer's weight sender dies as it begins to send, the engines paused for the transfer: "
                   "the refit rolls back (RefitSourceFailed naming it), the fleet keeps serving; the next update, "
                   "from a new sender, commits"),
    _v("misuse-stale-version", "recovers", [{"where": "call", "what": "stale_version", "step": 1}], steps=1,
       description="a refit of a version not above the committed one, requests in flight: refused, nothing changes"),
    _v("two-concurrent-refits", "recovers", [{"where": "call", "what": "concurrent_refit", "step": 1}], steps=1,
       description="two refits at once from two threads: one after the other, never interleaved"),
    _v("refit-under-load", "recovers", [{"where": "call", "what": "refit_under_load", "step": 1}], steps=1,
       description="a refit while 4 client threads submit without pause and a lagging client sends work routed "
                   "under the pre-refit state: 0 lost, 0 wrong version tags, every lagging request refused"),
    _v("freeze-between-refits", "recovers", [{"where": "between_refits", "what": "freeze", "shard": 2, "step": 1}],
       checks=("evicted:2", "resent:2"), steps=1,
       description="a shard frozen with a request in flight and no refit coming: evicted within "
                   "hang_detection_bound_s, its requests re-sent at the eviction and completed elsewhere"),
    # a stuck engine core under a live actor (issue 29, hole 0): the actor answers, its engine does not
    _v("freeze-core-between-refits", "recovers",
       [{"where": "between_refits", "what": "freeze_core", "shard": 2, "step": 1}],
       checks=("evicted:2", "resent:2", "reaped:2"), steps=1,
       description="an engine core SIGSTOPped with a request in flight, its shard actor answering: its missing "
                   "progress finds it within stall_detection_bound_s, the shard is evicted with its stopped "
                   "core, its requests re-sent and completed on the other two"),
    _v("freeze-core-during-transfer", "recovers",
       [{"where": "transfer", "what": "freeze_core", "shard": 0, "step": 1}],
       checks=("evicted:0", "reaped:0"),
       description="an engine core SIGSTOPped as a refit's bytes start moving into it: that transfer is cut at "
                   "its deadline, the refit commits on the other two within the phase's bound, and the shard "
                   "(answering, its core not) is evicted with its stopped core"),
    _v("controller-kill-between-refits", "recovers", [{"where": "between_refits", "what": "kill_controller", "step": 1}],
       checks=("controller_back",),
       description="the controller's process SIGKILLed from outside with requests in flight: they complete on "
                   "the shards meanwhile, Ray restarts it, it re-adopts the shards, the step's refit lands"),
    _v("controller-kill-during-pause", "recovers", [{"where": "pause", "what": "kill_controller", "step": 1}],
       checks=("controller_back",),
       description="the controller dies as the refit starts pausing: the successor resumes the paused shards, "
                   "serves the committed version and runs the re-sent refit"),
    _v("controller-kill-during-transfer", "recovers",
       [{"where": "transfer", "what": "slow", "shard": 0, "step": 1, "delay_s": SLOW_TRANSFER_S},
        {"where": "transfer", "what": "kill_controller", "step": 1, "delay_s": CRASH_IN_TRANSFER_S}],
       checks=("controller_back",),
       description="the controller dies with the transfer's calls in flight (one shard's held back): every "
                   "shard's weights are unknown, none serves them; the re-sent refit brings the fleet back"),
    _v("controller-kill-during-resume", "recovers", [{"where": "resume", "what": "kill_controller", "step": 1}],
       checks=("controller_back",),
       description="the controller dies after the commit, before resuming: the successor resumes the shards on "
                   "the committed version; the re-sent refit answers recovered"),
    _v("controller-kill-during-shutdown", "recovers", [{"where": "shutdown", "what": "kill_controller", "step": 1}],
       steps=1, description="the controller dies half way through the fleet's shutdown: the restarted one finishes "
                            "it; no shard actor of any incarnation is left, nor the controller"),
    _v("poison-request", "recovers", [{"where": "call", "what": "poison_request", "step": 1}], steps=1,
       fleet=ONE_OF_THREE,
       description="a prompt that crashes every engine it reaches: it takes down two engines, comes back as "
                   "poison (never sent a third time), is refused at once when sent again; the third engine "
                   "serves on"),
    _v("poison-in-batch", "recovers", [{"where": "call", "what": "poison_in_batch", "step": 1}], steps=1,
       fleet=ONE_OF_THREE,
       description="a poison prompt in a batch of 24 on three engines: the 7 or 8 requests that shared its first "
                   "engine are suspects, run one per shard without spending their timeout; every innocent "
                   "completes, the poison comes back as poison after at most two engines"),
    # the operator's pause where it meets a refit and a controller's death (issue 46): real engines, whose own
    # step records prove that nothing sampled while paused
    _v("operator-resume-mid-refit", "recovers", [{"where": "call", "what": "operator_resume_mid_refit", "step": 1}],
       steps=1,
       description="requests held by an operator's keep pause, a refit, and the operator's resume sent while its "
                   "transfer runs: every engine refuses it (the refit owns it), samples nothing until it is "
                   "stamped, and resumes at the refit's end; the held requests finish on the new weights"),
    _v("controller-kill-under-keep-pause", "recovers",
       [{"where": "call", "what": "controller_kill_under_keep_pause", "step": 1}], steps=1,
       description="the controller SIGKILLed while an operator's keep pause holds requests on the engines: Ray "
                   "restarts it, it re-adopts the fleet, the engines stay paused (sampling nothing) until the "
                   "operator's resume, then every held request completes"),
    # a paused engine's silence is not an absent engine (issue 47): real engines, whose stat logger stops with them
    _v("long-refit-keeps-admission-caps", "recovers",
       [{"where": "call", "what": "admission_hold_across_refit", "step": 1}], steps=1, fleet=ADMISSION_HOLD,
       description="a refit held paused, 12 requests on its engines, past the admission law's absent_fallback_s "
                   "(one engine's calls slowed): every shard's admission cap after it is its cap before, none fell "
                   "back to fallback_cap"),
    # the controller's decisions alone, on shards with no engine (``NULL``)
    _v("loop-error-then-kill", "recovers", [{"where": "call", "what": "loop_error_then_kill", "step": 1}], steps=1,
       fleet=NULL,
       description="two ticks of the controller's liveness monitor raise, then an engine with nothing in flight is "
                   "killed: the monitor went on, finds it dead within hang_detection_bound_s, and it restarts"),
    _v("resize-under-load", "recovers", [{"where": "call", "what": "resize_under_load", "step": 1}], steps=1,
       fleet=NULL,
       description="client threads submit without pause while the fleet grows by one engine, a refit lands (the "
                   "new engine serves after it), and it shrinks by one (the removed engine finishes what it held, "
                   "admits nothing more, is retired): 0 lost"),
    # on_hang=evict (the default): a hung engine is killed and the refit goes on
    _v("hang-at-pause-evicted", "recovers", [{"where": "pause", "what": "hang", "shard": 1, "step": 1}],
       checks=("evicted:1", "readmitted:1"), fleet=NULL,
       description="a pause that never returns: that engine is killed at the pause deadline, the refit commits "
                   "on the other two, the slot restarts and serves again (re-admitted, or by the next refit)"),
    _v("hang-at-resume-evicted", "recovers", [{"where": "resume", "what": "hang", "shard": 0, "step": 1}],
       checks=("evicted:0", "readmitted:0"), fleet=NULL,
       description="a resume that never returns: that engine is killed at the resume deadline, the gate reopens "
                   "on the other two, the slot restarts and serves again (re-admitted, or by the next refit)"),
    # a stale engine's re-admission from a live peer (issue 48) with a fault in the middle of its copy: the first
    # donor's journal line at ``donate`` tells the driver the copy is under way (``faults.readmit``)
    _v("readmit-donor-dies-mid-copy", "recovers", [{"where": "call", "what": "readmit_donor_killed", "step": 1}],
       steps=1, fleet=NULL,
       description="a restarted engine's first donor dies as it begins to send: the engine stays stale, the next "
                   "donor gives the weights (its end record names the dead one), and it serves the committed "
                   "version with no refit and no new version"),
    _v("readmit-engine-dies-mid-copy", "recovers", [{"where": "call", "what": "readmit_engine_killed", "step": 1}],
       steps=1, fleet=NULL,
       description="the stale engine is killed while its copy's send is held back: a normal restart (that "
                   "incarnation never served), and its next incarnation is re-admitted"),
    _v("readmit-yields-to-refit", "recovers", [{"where": "call", "what": "readmit_refit_mid_copy", "step": 1}],
       steps=1, fleet=NULL,
       description="the trainer's refit begins while a copy's send is held back, requests in flight: the copy "
                   "yields before the refit pauses anything, the refit takes the engine by its state, it serves "
                   "the refit's version, every request completes"),
    _v("controller-kill-during-readmit", "recovers",
       [{"where": "call", "what": "readmit_controller_killed", "step": 1}], steps=1, fleet=NULL,
       description="the controller SIGKILLed while a copy's send is held back: Ray restarts it, the successor "
                   "finds the engine stale and re-admits it; the committed version does not change"),
    _v("stamp-unavailable", "recovers", [{"where": "stamp", "what": "unavailable", "shard": 1, "step": 1}],
       checks=("restamped:1",), fleet={**NULL, **ONE_OF_THREE},
       description="set_weight_version answers 'unavailable' on one engine: its version is unknown, so it serves "
                   "nothing (a probe finds it alive: stale, never healthy) until it is re-stamped (re-admitted, "
                   "or by the next refit)"),
    _v("restart-budget-exhausted", "recovers",
       [{"where": "step_boundary", "what": "kill", "shard": 1, "step": 1, "every": 1, "times": 2}],
       checks=("retired:1",), fleet={**NULL, **PAIR, "min_healthy_engines": 1, "restart_budget": 1},
       description="the same slot killed past its restart budget is retired; quorum still holds"),
    _v("spare-promotion", "recovers", [{"where": "between_refits", "what": "kill", "shard": 0, "step": 1}],
       checks=("promoted:0",), steps=1,
       fleet={**NULL, "num_engines": 2, "min_healthy_engines": 2, "spare_engines": 1,  # 2 serve, 1 warm spare
              "engine": {**NULL_ENGINE, "null_start_s": 5.0}},  # a restart takes an engine's start
       description="a serving engine killed between refits under load: the warm spare is promoted before the "
                   "killed slot's restart ends, the gate stays open (2 of 2 needed), the restarted slot is the "
                   "new spare"),
    _v("below-quorum-between-refits", "recovers",
       [{"where": "between_refits", "what": "kill", "shard": 0, "step": 2},
        {"where": "between_refits", "what": "kill", "shard": 1, "step": 2}],
       checks=("below_quorum", "readmitted:0", "readmitted:1", "delta_refused:0"), steps=2,
       fleet={**NULL, "readmit": False},
       description="two of three shards die between refits, past the checkpoint's version (a restart at "
                   "version 0 would serve at once), with no re-admission from a peer (the refit path, as when "
                   "no donor is left): requests wait at the closed gate until the restarted shards come back "
                   "and the next refit brings quorum back; its patches are refused by the restarted engines "
                   "(they do not hold the base) and the same refit sends the update whole"),
    # a refit that stages its update while the fleet serves (``stage_ahead``), where its faults meet the staging
    _v("kill-during-stage", "recovers", [{"where": "transfer", "what": "kill", "shard": 1, "step": 1}],
       checks=("readmitted:1",), fleet=STAGING,
       description="a shard killed as the update's bytes start moving into its staging area, the gate open: the "
                   "staging retries on a rebuilt group without it, the refit applies on the others, the slot "
                   "restarts and serves again (re-admitted, or by the next refit)"),
    _v("controller-kill-during-stage", "recovers", [{"where": "stage", "what": "kill_controller", "step": 1}],
       checks=("controller_back",), fleet=STAGING,
       description="the controller dies while the engines stage the update, the gate open: Ray restarts it, it "
                   "re-adopts the fleet (nothing live changed), and the re-sent refit stages and lands"),
    _v("false-ack-on-pause", "stops", [{"where": "pause", "what": "false_ack", "shard": 1, "step": 1}], steps=1,
       checks=("stop_names:1",), fleet={**NULL, **PAIR},
       description="a pause acknowledged with something other than True: never counted as paused; the refit "
                   "stops with the gate closed, naming the engine"),
    _v("kill-two-below-quorum", "stops",
       [{"where": "step_boundary", "what": "kill", "shard": 0, "step": 1},
        {"where": "pause", "what": "kill", "shard": 1, "step": 1}],
       checks=("stop_names:0", "stop_names:1"), fleet={**NULL, "restart_dead_engines": False}, steps=1,
       description="one shard killed at the step boundary, another as its pause arrives, no restarts: the refit "
                   "stops with the gate closed, naming both"),
    _v("hang-past-deadline", "stops", [{"where": "pause", "what": "hang", "shard": 1, "step": 1}], steps=1,
       fleet={**NULL, **PAIR, "on_hang": "stop"},
       description="on_hang=stop: a pause that never returns: the refit stops with the gate closed within its "
                   "deadline"),
    _v("false-ack-on-resume", "stops", [{"where": "resume", "what": "false_ack", "shard": 1, "step": 1}], steps=1,
       fleet={**NULL, **PAIR}),
    _v("unavailable-at-resume", "stops", [{"where": "resume", "what": "unavailable", "shard": 1, "step": 1}], steps=1,
       checks=("stop_names:1",), fleet={**NULL, **PAIR, "on_hang": "stop"},
       description="on_hang=stop: a resume answers 'unavailable': nobody can tell whether that engine resumed; "
                   "the refit stops"),
    _v("hang-at-resume", "stops", [{"where": "resume", "what": "hang", "shard": 0, "step": 1}], steps=1,
       checks=("stop_names:0",), fleet={**NULL, **PAIR, "on_hang": "stop"},
       description="on_hang=stop: a resume that never returns: the refit stops within its deadline"),
)


def by_name(names: list[str] | None = None) -> list[Variant]:
    if not names:
        return list(MATRIX)
    known = {v.name: v for v in MATRIX}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"unknown matrix variant(s) {missing}; known: {sorted(known)}")
    return [known[n] for n in names]
