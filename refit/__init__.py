"""Weight transport for rlfleet: move the trainer's new weights into every participating engine.

Fast (bucketed broadcast over ``torch.distributed``: gloo on CPU, nccl on GPU, one code
path), bounded (every blocking call has a deadline; a peer that dies or freezes turns
into an error on every survivor within the transfer timeout), and honest (each engine
reports what it holds now: not started / partial / complete). This package imports
nothing from ``fleet`` or ``health`` and nothing from Ray: the caller adapts its
handles to two small ports.

Contract for the controller (``fleet``)
---------------------------------------

Participants are plain data from the membership plan::

    Participant(slot, incarnation, ranks)     # ranks: one per weight-holding worker

Rank 0 is always the trainer's sender; engines take ranks 1..N, consecutive per
engine (a TP=2 engine takes two). Ask each engine its worker count with
``worker_rpc("rlfleet_worker_info")`` (one dict per worker) and lay ranks out with
``assign_ranks({(slot, incarnation): n_workers, ...})``.

Ports (``refit.ports``)::

    ReceiverPort:  async worker_rpc(method, args=(), kwargs=None, timeout=None) -> list   # one result per worker
    SenderPort:    async open_group / connect / close_group / prepare / send               # see ports.py

``EngineShard.worker_rpc`` already is a receiver port once wrapped over its Ray
handle (``fleet.cluster.ray_door.ShardReceiverPort(handle)``). The sender lives in the
trainer's process: ``LocalSenderPort(WeightSender(model))`` in-process, or an actor
whose class is a ``LocalSenderPort`` (the recipe's ``GRPOTrainerActor``, the test and
benchmark ``faults.source.WeightSource``) behind ``fleet.cluster.ray_door.ActorSenderPort(handle)``.

Driving a refit (the controller's steps 4-7)::

    sync = WeightSynchronizer(sender_port, RefitConfig(backend="gloo", bucket_mb=16,
                                                       apply_mode="staged", timeout_s=60))

    report = await sync.refit({participant: port, ...}, version, epoch)
    if not report.ok and not report.refused:    # the controller's one retry (fleet.control.lifecycle.transfer):
        ...                                     # rebuild without the failed, re-pause, epoch += 1
        report = await sync.refit({participant: port, ...}, version, epoch)
    if report.refused:                          # the update does not fit the model: no retry, nothing changed
        ...
    for key, res in report.results.items():     # res.outcome: NOT_STARTED / PARTIAL / COMPLETE
        ...                                     # res.error, res.phase, res.refused, res.bytes_moved, res.exception
    # on COMPLETE: shard.set_weight_version(version); then resume

``refit(participants, version, epoch) -> RefitReport`` guarantees:

- a new group (fresh ``TCPStore`` on a new free port, new ``PrefixStore``) is built when
  ``epoch`` differs from the last refit's, when the participant set changed, or after
  any failed refit; the old group is closed on the sender and left by old members;
  surviving engines are never restarted to join a new epoch. No default process group
  of vLLM or of the trainer is created or touched;
- every member's call is bounded and all settle (``asyncio.gather``) before it returns;
  participant failures are reported, never raised. Only sender-side misuse raises
  ``RefitUsageError`` (bad rank layout, empty plan, bad config);
- an update that does not fit the model is *refused* by every engine before any byte
  moves: a wrong name, shape or dtype, a tensor or a whole layer missing without the
  sender's declaration, a decoder layer sent in part. Every participant is then
  NOT_STARTED in phase "prepare" with ``res.refused`` set to the message naming the
  tensors (``"tensor model.layers.0.mlp.down_proj.weight: shape (3, 3), engine expects
  (128, 512)"``, ``"missing tensors: model.layers.1.* (9 tensors); ..."``), and
  ``report.refused`` is that message. The caller's mistake, not an engine's failure:
  no engine changed its weights or version, the group is kept, a retry of the same
  update cannot succeed;
- a partial update is declared by the sender: ``WeightSender(model, partial=True)``
  (whatever it does not yield is left out) or ``WeightSender(model, frozen=[names or
  fnmatch patterns])``; engines keep exactly the tensors left out (whole decoder layers
  or top-level tensors: vLLM fuses q/k/v and gate/up into one parameter);
- ``RefitConfig(verify="checksum")`` (default ``"none"``): the sender digests the
  update between prepare and send, every engine digests what it applied, and an engine
  is COMPLETE (and stamps the version) only if the two agree; a mismatch is PARTIAL in
  phase "verify", the error naming the engine and both digests (an engine failure, not
  a refusal);
- ``staged`` (default): an engine's weights change only in one apply after every byte
  arrived; a transfer failure leaves it NOT_STARTED with its old weights and version.
  ``streaming``: whole layers are applied as they arrive (low memory); a failure after
  the first apply is PARTIAL. The worker extension stamps ``version`` only after a
  complete apply (``rlfleet_worker_info()["weight_version"]``); the shard-level tag is
  the controller's (``set_weight_version``);
- when an engine could not answer at all, its outcome is judged by what the sender
  moved: staged -> PARTIAL only if the sender finished (it may have been applying);
  streaming -> PARTIAL as soon as any byte moved. ``report.ok`` is True only if the
  sender finished and every participant is COMPLETE.

Worker extension methods (``refit.worker_extension.RefitWorkerExtension``, all prefixed
``rlfleet_``): ``worker_info``, ``join``, ``leave``, ``prepare``, ``receive``,
``checksum``, ``receive_raw`` (benchmark baseline), ``inject_fault`` (tests).
``rlfleet_checksum()`` returns the digest of exactly what the last refit handed to
``reload_weights`` (with ``RefitConfig(checksum=True)``) and a read-back digest of the
live parameters that are readable under their checkpoint name and shape (embeddings,
norms, lm_head, and the unfused linears such as ``o_proj``; vLLM fuses q/k/v and
gate/up under other names). Equal digests prove the bytes arrived intact and, for the
read-back part, that they are live; the fused linears are proven live by logprob
agreement with the trainer.

Peer copy (``refit.peer``, ``refit.peer_transfer``; the shard's side is
``fleet.shard.peer_copy``): a live engine sends its parameters, in vLLM's own layout, to
an engine of the same layout, rank to rank, with no trainer: ``rlfleet_peer_manifest``,
``rlfleet_peer_open`` / ``rlfleet_peer_status`` / ``rlfleet_donate`` / ``rlfleet_peer_close``
on the donor, ``rlfleet_receive_peer`` on the receiver, ``rlfleet_weight_digests`` (vLLM's
``compute_weight_checksums``) on both. On CPU it needs vLLM's linear weights kept readable
(``refit.readable_weights``, on by default).
"""

from rlfleet.refit.errors import ApplyError, ManifestError, RefitError, RefitUsageError, TransferError
from rlfleet.refit.outcome import Outcome, Participant, ParticipantResult, PhaseTimings, RefitReport, assign_ranks
from rlfleet.refit.ports import LocalSenderPort, ReceiverPort, SenderPort
from rlfleet.refit.sender import WeightSender
from rlfleet.refit.sharded_sync import ShardedSource, ShardedSynchronizer
from rlfleet.refit.synchronizer import RefitConfig, WeightSynchronizer

__all__ = [
    "ApplyError", "LocalSenderPort", "ManifestError", "Outcome", "Participant", "ParticipantResult", "PhaseTimings",
    "ReceiverPort", "RefitConfig", "RefitError", "RefitReport", "RefitUsageError", "SenderPort", "ShardedSource",
    "ShardedSynchronizer", "TransferError", "WeightSender", "WeightSynchronizer", "assign_ranks",
]
