"""One refit process group per membership epoch, built beside (never inside) the default group.

``torch.distributed`` is used only through explicit objects: a ``TCPStore`` the
sender hosts on a fresh port for every epoch, a ``PrefixStore`` per epoch, and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built on it. No default
process group is created, read or changed, so vLLM's own groups and the trainer's
are untouched. The same code path serves both backends; only the device of the
buffers differs.

Failure guarantees:

- every blocking call takes a deadline and raises ``TransferError`` when it passes
  (``Work.wait(timeout)``); group construction is bounded by the store timeout;
- receivers also watch the sender's store while they wait: when the sender gives up
  (a peer died) it sets an abort key, and every receiver stops within ``ABORT_POLL_S``;
  a vanished store (sender process gone) counts as an abort;
- ``close()`` never blocks: a gloo group with an operation still pending blocks in
  its destructor until that operation ends, so groups are released on a reaper
  thread. Dropping the sender's group closes its sockets, which makes every
  receiver still waiting on it fail at once instead of waiting out its timeout;
- after any failed collective the group is ``broken`` and must be replaced by a
  new epoch; it is never used again.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlfleet.refit.errors import RefitUsageError, TransferError

BACKENDS = ("gloo", "nccl")
_MAGIC = 0x52464C54  # "RFLT"
_ABORT_KEY = "abort"
ABORT_POLL_S = 0.05  # how often a waiting receiver looks for the sender's abort signal
STORE_POLL_TIMEOUT_S = 1.0  # bound of one such look (a frozen sender host cannot stall it longer)


class _SenderAborted(Exception):
    pass


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks of one epoch meet. Plain data; travels through the control RPC."""

    addr: str
    port: int
    epoch: int
    world_size: int
    backend: str
    op_timeout_s: float = 1800.0  # the process group's own timeout for one collective (>= any transfer deadline)

    def to_wire(self) -> dict:
        return {
            "addr": self.addr, "port": self.port, "epoch": self.epoch, "world_size": self.world_size,
            "backend": self.backend, "op_timeout_s": self.op_timeout_s,
        }

    @classmethod
    def from_wire(cls, d) -> "GroupAddress":
        return cls(str(d["addr"]), int(d["port"]), int(d["epoch"]), int(d["world_size"]), str(d["backend"]), float(d.get("op_timeout_s", 1800.0)))


def default_address() -> str:
    """The address peers use to reach this host: ``RLFLEET_REFIT_ADDR``, else the outbound interface, else loopback."""
    env = os.environ.get("RLFLEET_REFIT_ADDR")
    if env:
        return env
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def resolver_stall_s(resolv_conf: str = "/etc/resolv.conf", env: dict | None = None) -> float:
    """The longest one DNS lookup can block this host: glibc's per-try timeout, doubled at each of its tries
    (``options timeout:N attempts:M`` in ``resolv_conf``, overridden by ``RES_OPTIONS``; 5 s and 2 tries by
    default: 5 + 10 s). torch's store client looks the store's address up in reverse DNS before every connect
    (c10d's ``SocketImpl`` names its peer; pytorch#159007), inside the connect's own deadline, so a resolver that
    dropped one packet costs a connect that long: a bound on reaching a store must allow it."""
    timeout, attempts = 5, 2
    try:
        with open(resolv_conf) as f:
            lines = [ln.split()[1:] for ln in f if ln.split()[:1] == ["options"]]
    except OSError:
        lines = []
    extra = (os.environ if env is None else env).get("RES_OPTIONS", "").split()
    for opt in [o for ln in lines for o in ln] + extra:
        name, _, value = opt.partition(":")
        if name in ("timeout", "attempts") and value.isdigit():
            if name == "timeout":
                timeout = min(int(value), 30)  # glibc's caps
            else:
                attempts = min(int(value), 5)
    return float(max(1, timeout) * (2 ** max(1, attempts) - 1))


def device_for(backend: str, device: torch.device | str | None = None) -> torch.device:
    if backend not in BACKENDS:
        raise RefitUsageError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gloo":
        return torch.device("cpu")
    return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, float(seconds)))


# -- release off the caller's thread ---------------------------------------------------------


def _drop(objs: list) -> None:
    for o in objs:
        if type(o).__name__ == "ProcessGroupNCCL":
            try:
                o.abort()  # NCCL needs an explicit abort to unblock pending collectives
            except Exception:  # noqa: BLE001 - best effort on a dead group
                pass
    o = None
    objs.clear()  # the destructors run here, possibly blocking until a pending op ends


def _release(holder: list) -> None:
    """Drop the objects in ``holder`` on a fresh daemon thread, so no caller blocks in a destructor.

    The caller must hold no other reference: the list is the only owner, and it is
    emptied on the release thread.
    """
    if any(o is not None for o in holder):
        t = threading.Thread(target=_drop, args=(holder,), name="rlfleet-refit-release", daemon=True)
        _RELEASING.add(t)
        t.start()


_RELEASING: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # release threads, until they are collected


def wait_released(timeout_s: float) -> bool:
    """Wait (up to ``timeout_s`` in all) for the groups this process closed to be dropped; True if none is left.

    A process that is about to exit calls it: a group whose destructor still runs on its daemon release
    thread while the interpreter tears down ends the process with ``std::terminate`` (exit -6)."""
    deadline = time.monotonic() + timeout_s
    for t in list(_RELEASING):
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in list(_RELEASING))


# -- the group ----------------------------------------------------------------------------

def host_store(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Start a rendezvous store on a fresh free port (rank 0 only)."""
    return dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False, timeout=_td(timeout_s))


def _make_pg(store, rank: int, world: int, backend: str, timeout_s: float):
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(timeout_s)
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _td(timeout_s)
    return dist.ProcessGroupNCCL(store, rank, world, opts)


class RefitGroup:
    """This process's rank in the refit group of one epoch.

    Preconditions: rank 0 passes the store it hosts (``host_store``); other ranks
    pass ``store=None`` and connect to ``address``. Construction blocks until every
    rank joined and the handshake (epoch check) passed, or raises ``TransferError``
    after ``timeout_s``. ``connect_s``: a shorter bound on reaching the store alone, for a rank given the
    address only once its host was up (a peer copy's receiver): a store that does not answer by then is
    gone with its host, and torch's client would retry it for the whole ``timeout_s`` otherwise.
    """

    def __init__(self, address: GroupAddress, rank: int, timeout_s: float, store=None, device=None,
                 connect_s: float | None = None) -> None:
        if not 0 <= rank < address.world_size:
            raise RefitUsageError(f"rank {rank} outside world of size {address.world_size} (epoch {address.epoch})")
        self.address = address
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.device = device_for(address.backend, device)
        self.broken = False
        self._store = store
        self._prefix: dist.PrefixStore | None = None
        self._pg = None
        t0 = time.monotonic()
        try:
            if self._store is None:
                connect = timeout_s if connect_s is None else min(float(timeout_s), float(connect_s))
                try:
                    self._store = dist.TCPStore(address.addr, address.port, address.world_size, is_master=False,
                                                timeout=_td(connect))
                except Exception as exc:  # noqa: BLE001 - nothing answered there: say so, not the group's budget
                    raise TransferError(f"rank {rank} could not join the refit group of epoch {address.epoch}: nothing "
                                        f"answered at {address.addr}:{address.port} within {connect:.1f} s (is its "
                                        f"host up?): {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
                if connect < timeout_s:  # reached: the group's own waits on it get the whole budget
                    self._store.set_timeout(_td(timeout_s))
            self._prefix = dist.PrefixStore(f"rlfleet/epoch{address.epoch}", self._store)
            self._pg = _make_pg(self._prefix, rank, address.world_size, address.backend, max(timeout_s, address.op_timeout_s))
            self._handshake(t0 + self.timeout_s)
            if rank != 0:  # abort polls must stay short even if the sender's host froze
                self._store.set_timeout(_td(STORE_POLL_TIMEOUT_S))
        except TransferError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - store/connect failures of every kind
            self.close()
            raise TransferError(f"rank {rank} could not join the refit group of epoch {address.epoch} at {address.addr}:{address.port} within {timeout_s:.1f} s: {type(exc).__name__}: {exc}") from None
        self.build_s = time.monotonic() - t0

    def _handshake(self, deadline: float) -> None:
        a = self.address
        hello = torch.tensor([_MAGIC, a.epoch, a.world_size], dtype=torch.int64, device=self.device)
        if self.rank != 0:
            hello.zero_()
        self.wait(self.broadcast(hello), deadline, "handshake", self.timeout_s)
        got = [int(x) for x in hello.cpu().tolist()]
        if got != [_MAGIC, a.epoch, a.world_size]:
            raise TransferError(f"handshake of epoch {a.epoch} on rank {self.rank} got {got}: a rank of another epoch is on this port")

    def broadcast(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast of ``tensor`` (contiguous, on ``self.device``) from ``root``; returns the work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self._live().broadcast([tensor], opts)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Start a point-to-point send of ``tensor`` to rank ``dst`` (a sharded refit); returns the work."""
        return self._post("send", dst, lambda pg: pg.send([tensor], int(dst), int(tag)))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0):
        """Start a point-to-point receive into ``tensor`` from rank ``src``; returns the work."""
        return self._post("receive", src, lambda pg: pg.recv([tensor], int(src), int(tag)))

    def _post(self, what: str, peer: int, start):
        """Start a point-to-point operation; a peer already gone fails it here, as ``TransferError``."""
        pg = self._live()
        try:
            return start(pg)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError for a closed pair
            self.broken = True
            raise TransferError(f"{what} with rank {peer} failed to start on rank {self.rank} of epoch "
                                f"{self.address.epoch}: {type(exc).__name__}: {str(exc)[:300]}") from None

    def _live(self):
        if self._pg is None or self.broken:
            raise TransferError(f"refit group of epoch {self.address.epoch} is {'broken' if self.broken else 'closed'}; rebuild it")
        return self._pg

    def wait(self, work, deadline: float, what: str, budget_s: float) -> None:
        """Wait for ``work`` until the monotonic ``deadline`` (of a ``budget_s`` budget); raise ``TransferError`` naming ``what``.

        Receiving ranks also stop at once when the sender signalled an abort (or its store
        vanished): a survivor never waits out its deadline for a transfer the sender gave up.
        """
        try:
            if self.rank != 0:
                self._wait_watching_sender(work, deadline)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            work.wait(_td(remaining))
        except _SenderAborted as exc:
            self.broken = True
            raise TransferError(f"{what} stopped on rank {self.rank} of epoch {self.address.epoch}: the sender aborted the transfer ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - gloo/nccl raise RuntimeError subclasses
            self.broken = True
            late = time.monotonic() >= deadline - 1e-3
            cause = "timed out" if late or "timed out" in str(exc).lower() else "failed"
            raise TransferError(
                f"{what} {cause} on rank {self.rank} of epoch {self.address.epoch} "
                f"({budget_s - max(0.0, deadline - time.monotonic()):.2f} s into a {budget_s:.1f} s budget): {type(exc).__name__}: {str(exc)[:300]}"
            ) from None

    def _wait_watching_sender(self, work, deadline: float) -> None:
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's point-to-point work has no future, and reports completion only in its
            return  # ``wait``: the caller's bounded ``wait`` is the watch (a dead peer's closed pair fails it at once)
        done = threading.Event()
        future.add_done_callback(lambda _f: done.set())
        while not done.wait(min(ABORT_POLL_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError("deadline passed")
            self._check_abort()

    def _check_abort(self) -> None:
        prefix = self._prefix
        if prefix is None:  # ``close`` ran (on another thread) under the wait
            raise _SenderAborted("the group was closed")
        try:
            flagged = prefix.check([_ABORT_KEY])
        except Exception as exc:  # noqa: BLE001 - the store lives in the sender: gone means the sender is gone
            raise _SenderAborted(f"its rendezvous store is unreachable: {type(exc).__name__}") from None
        if flagged:
            raise _SenderAborted(prefix.get(_ABORT_KEY).decode(errors="replace")[:300])

    def signal_abort(self, reason: str) -> None:
        """Sender: tell every receiver of this epoch to stop now (best effort, never raises)."""
        try:
            if self._prefix is not None:
                self._prefix.set(_ABORT_KEY, reason[:1000])
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Drop the group without blocking (see module docstring). Idempotent."""
        holder = [self._pg, self._prefix, self._store]
        self._pg = self._prefix = self._store = None
        self.broken = True
        _release(holder)
