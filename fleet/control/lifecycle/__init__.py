"""The refit lifecycle: ``sync_weights(version)`` as the steps of DESIGN.md, in seven phases.

Under ``stage_ahead`` a step 0 comes first, with the gate open: the update moves into
every live engine's staging area while the fleet serves (``stage_ahead``); the transfer
is then only the apply of what each paused engine staged. A failure while staging never
closes the gate: the refit is refused (``RefitRefused``, ``RefitNotStaged``) and the
fleet serves what it had.

``RefitLifecycle.run`` (``steps``) reads like the design: close the gate, reconcile membership,
pause the participants (in the same call each aborts its requests too old for the new
version), transfer (classify, rebuild, re-pause, retry exactly once, only the engines
that failed, all within the phase's one deadline), commit the version, resume (in the
same call each engine is stamped first) under one shared deadline, reopen only with
quorum. An engine costs three control calls a refit: ``begin_refit`` with its pause,
its transfer, ``end_refit``; the order inside each call never varies, so fusing them
loses no decision point. The weight sender plans the update (its ``prepare``: the
manifest, which depends only on what it holds) while the gate closes and the engines
pause (``TransferPort.plan_ahead``); the first transfer attempt takes that plan. Every
fan-out settles every call before any result is acted on, and every call is bounded by
``refit_timeout_s + grace``.

Guarantee on failure: arguments are checked before anything changes (a version
that does not increase, a source that is not a sender: refused, nothing touched).
After that, a refit ends in exactly one of three ways: committed and reopened;
rolled back (nothing reached any engine's live weights, e.g. the update was refused
or the weight sender failed: paused engines resumed on the committed version, gate
reopened on it, the caller's error raised: ``RefitRefused``, ``RefitSourceFailed``,
``RefitNotDelivered``); or stopped (``ends.end``:
gate closed, held requests returned, ``RefitFailed``/``FleetExhausted`` naming the
shards and the phase). Never engines paused with the gate closed and the fleet
"not stopped". Engines that did not receive the complete new weights keep their
old version tag (or are fenced from serving when partial).

The package, one job a module: ``run`` (``RefitRun``: one refit's state and the tools its steps share),
``pause`` (steps 1-3), ``transfer`` (step 4 with its retry; step 0 and the apply under ``stage_ahead``),
``resume`` (steps 5-7), ``ends`` (stopped, rolled back) and ``steps`` (``RefitLifecycle``, the order).
"""

from __future__ import annotations

from rlfleet.fleet.control.lifecycle.steps import RefitLifecycle
from rlfleet.health.faultplan import REFIT_PHASES

PHASES = REFIT_PHASES  # close, reconcile, pause, transfer, commit, resume, reopen (``health.faultplan``)

__all__ = ["PHASES", "RefitLifecycle"]
