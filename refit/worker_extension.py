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
- live tensors: ``model.named_parameters()`` (on CPU only embeddings, norms and
  lm_head have readable data; packed linears read as empty).

Stage ahead: ``rlfleet_stage`` starts the receive on a thread and returns at once (the
engine keeps serving), ``rlfleet_stage_status`` polls it, ``rlfleet_apply_staged`` applies
the staging area in a short call.

All methods return plain data and never raise for transfer or validation failures.
"""

from __future__ import annotations

import os

from refit.receiver import WeightReceiver


class _VllmModel:
    """``ModelAdapter`` over a vLLM worker."""

    def __init__(self, worker) -> None:
        self._worker = worker

    @property
    def _config(self):
        return self._worker.model_runner.model_config

    def expected_spec(self):
        from refit.model_spec import checkpoint_spec

        return checkpoint_spec(self._config.model)

    def engine_dtype(self):
        return str(self._config.dtype).removeprefix("torch.")

    def apply(self, weights) -> None:
        self._worker.model_runner.reload_weights(weights_iterator=weights)

    def live_tensors(self):
        return self._worker.model_runner.get_model().named_parameters()


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

    def rlfleet_inject_fault(self, kind: str | None, at_bucket: int = 0, freeze_s: float = 3600.0) -> bool:
        """Tests only: ``die`` (exit the process), ``freeze`` (sleep) at a bucket of the next receive, ``fail_apply``
        or ``corrupt`` (change one element of what the next apply loads)."""
        return self._rlfleet_receiver().inject_fault(kind, at_bucket, freeze_s)
