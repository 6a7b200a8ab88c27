"""The typed wire: every record that crosses a shard's door, named in code and positional on the wire.

Learned from vLLM v1's engine-core wire (``EngineCoreRequest``): each record is a ``msgspec.Struct`` with
``array_like=True`` (encoded as one array of its values in field order: no field names travel) and
``frozen=True`` (a record is a message, never state). Code reads fields by name; the wire holds positions.
The field order of a record is part of the wire: append new fields at the end, never reorder; a request
with more fields than the shard knows is refused (``forbid_unknown_fields``): clients and shards of a
fleet run one wire.

- ``ServeRequest``: the request a client sends to a shard (``EngineShard.serve``, ``serve_many``,
  ``submit``). It crosses Ray as msgpack bytes (``ServeRequest.encode``): Ray passes bytes through
  without pickling them, and the shard decodes them into a typed record (``decode_request``), which checks
  every field's type on the way. (Ray's serializer pickles a tuple argument, ~7 us a request on the bench
  machine, and a struct, ~11 us; bytes cost it ~0.3 us, and encoding and decoding ~0.3 us each.) ``Carried`` is what a continued request brings (``fleet.shard.continuation``).
- The answers of the shard's control calls, read by the control plane: ``Ping``, ``Started``,
  ``Description`` (the three carry ``ShardInfo``'s facts first), ``Counters`` (with ``Left``),
  ``BeginRefit``, ``EndRefit``, and a peer copy's (``fleet.shard.peer_copy``): ``PeerManifest``, ``PeerOffer``,
  ``Donated``, ``PeerReceived``, ``WeightDigests``. They cross Ray pickled (a struct pickles as its class and its values in order:
  an ``EndRefit`` carries the stamp's exception). Every shard world answers with them: the real shard, the
  simulator's (``sim.shard``) and the unit tests' fakes. ``Record.to_dict`` is the plain form, for the
  outer boundaries that hand them to people and tools (``Fleet.shard_counters``).

Pure: no Ray, no vLLM.

Guarantee on failure: a malformed request (not the wire's bytes, the wrong number of fields, a field of the
wrong type) raises ``BadRequestError`` naming the field, before anything runs on the shard: a user's mistake
ends that request, never the shard or the fleet.
"""

from __future__ import annotations

import numbers
import pickle
import re
from typing import Any

import msgspec

from rlfleet.fleet.data.routing_state import Ticket, VersionPolicy
from rlfleet.fleet.errors import BadRequestError

__all__ = ["BeginRefit", "Carried", "Counters", "Description", "Donated", "EndRefit", "Left", "PeerManifest",
           "PeerOffer", "PeerReceived", "Ping", "Record", "ServeRequest", "ShardFacts", "ShardInfo", "Started",
           "WeightDigests", "decode_request"]

_PICKLED = 1  # msgpack extension code: a sampling value msgpack has no type for, pickled (as Ray would have)


class Record(msgspec.Struct, array_like=True, frozen=True):
    """A record on the wire (module docstring). Each record says ``array_like=True, frozen=True`` again: a
    struct inherits them, but the type checker reads them from the class's own line."""

    def to_dict(self) -> dict[str, Any]:
        """The record as a plain dict, nested records too (the keys the untyped answers had)."""
        return {name: _plain(getattr(self, name)) for name in self.__struct_fields__}


def _plain(value: Any) -> Any:
    return value.to_dict() if isinstance(value, Record) else value


# -- the data plane ---------------------------------------------------------------------------------------
class Carried(Record, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What a continued request brings: ``tokens`` completion tokens at the end of its prompt, of which the
    caller holds the text ``text``, the oldest weight version that sampled them (``oldest``)."""

    tokens: int
    text: str
    oldest: int


class ServeRequest(Record, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One request from a client to a shard (``fleet.data.dispatch`` builds it, ``EngineShard`` serves it).

    ``prompt`` (text or token ids) and ``sampling`` as ``generate`` takes them; ``request_id`` (idempotent
    re-sends) and ``cache_salt``; the ticket the shard's gate checks (``epoch``, the version policy as
    ``policy_kind``/``policy_k``, the admission ``cap``, ``suspect``: 0, or a suspect's allowance); how to stream (``first_at_once``: the
    first token at once, for a caller waiting on it; ``interval_s``: at most one chunk per that many seconds
    after it); ``carried``: what a continuation brings, or None."""

    prompt: str | list[int]
    sampling: dict[str, Any]
    request_id: str | None
    cache_salt: str | None
    epoch: int
    policy_kind: str
    policy_k: int
    cap: int | None
    first_at_once: bool
    interval_s: float
    carried: Carried | None
    suspect: int

    def encode(self) -> bytes:
        """The wire form: one msgpack array, values in field order. Tuples come back as lists, NumPy and torch
        numbers and arrays as plain ones, and any other sampling value goes pickled (``_sendable``: a vLLM
        dataclass such as ``StructuredOutputsParams`` must arrive as itself, not as the dict msgspec would make
        of it). Raises ``BadRequestError`` if a value cannot be sent."""
        return _encoded(self)

    def ticket(self) -> Ticket:
        """What the shard's gate checks (``fleet.shard.request_gate``)."""
        return Ticket(self.epoch, VersionPolicy(self.policy_kind, self.policy_k), self.cap, self.suspect)


def _encoded(value: Any) -> bytes:
    """``value`` (a ``ServeRequest``, or a sequence from an in-process caller) as msgpack bytes."""
    try:
        if isinstance(value, ServeRequest) and any(type(v) not in _PLAIN for v in value.sampling.values()):
            value = msgspec.structs.replace(value, sampling={k: _sendable(v) for k, v in value.sampling.items()})
        try:
            return _ENCODER.encode(value)
        except UnicodeEncodeError:  # text msgpack cannot hold (a lone surrogate): the shard's own check names it
            if not isinstance(value, ServeRequest):
                raise
            if isinstance(value.prompt, str) and not _utf8(value.prompt):
                raise BadRequestError("prompt holds text that is not valid Unicode (a lone surrogate); "
                                      "send it as valid text or as token ids") from None
            sampling = {k: _sendable(v, strict=True) for k, v in value.sampling.items()}
            return _ENCODER.encode(msgspec.structs.replace(value, sampling=sampling))
    except BadRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - a value neither msgpack nor pickle can carry: the caller's
        raise BadRequestError(f"serve request: cannot be put on the wire ({type(exc).__name__}: {exc})") from None


_PLAIN = frozenset({str, int, float, bool, type(None)})


def _sendable(value: Any, strict: bool = False) -> Any:
    """``value`` as msgpack carries it unchanged: plain values and their lists and dicts as they are, NumPy and
    torch numbers and arrays as the plain numbers they hold, anything else pickled (``_PICKLED``). ``strict``:
    text that is not valid UTF-8 (a lone surrogate) goes pickled too, for the shard's own check to refuse."""
    if type(value) is str and strict and not _utf8(value):
        return msgspec.msgpack.Ext(_PICKLED, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    if type(value) in _PLAIN:
        return value
    if isinstance(value, dict):
        return {k: _sendable(v, strict) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sendable(v, strict) for v in value]
    return _enc_hook(value)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _enc_hook(value: Any) -> Any:
    """A value msgpack has no type for (never a plain int, str, list or dict: they cost nothing here): a number
    or array type (NumPy's, torch's: token ids often come so) as the plain numbers it holds, anything else
    pickled."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return msgspec.msgpack.Ext(_PICKLED, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _PICKLED:
        raise ValueError(f"unknown msgpack extension {code}")
    return pickle.loads(data)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(ServeRequest, ext_hook=_ext_hook)
_FIELDS = ServeRequest.__struct_fields__
_AT = re.compile(r"`\$\[(\d+)\]")  # the field's position in msgspec's path (``$[4]``, ``$[0][1]``)


def decode_request(raw: Any) -> ServeRequest:
    """The shard's reading of a request: its wire bytes (``ServeRequest.encode``) decoded and checked; any
    other form (a ``ServeRequest`` or a sequence, from an in-process caller) goes through the same check.
    Raises ``BadRequestError`` naming the field that is wrong."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raw = _encoded(raw)
    try:
        return _DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequestError(_refusal(raw, exc)) from None


def _refusal(raw: Any, exc: Exception) -> str:
    """Why ``raw`` is not a ``ServeRequest``, naming the field (the error path only: it decodes ``raw`` again)."""
    try:
        items = msgspec.msgpack.decode(raw, ext_hook=_ext_hook)
    except Exception:  # noqa: BLE001 - not msgpack at all
        return f"serve request: not the wire's bytes ({exc})"
    if not isinstance(items, list):
        return f"serve request: an array of {len(_FIELDS)} fields ({', '.join(_FIELDS)}), got {type(items).__name__}"
    if len(items) < len(_FIELDS):
        missing = ", ".join(_FIELDS[len(items):])
        return f"serve request: field(s) {missing} missing ({len(items)} of {len(_FIELDS)} sent)"
    if len(items) > len(_FIELDS):
        return f"serve request: {len(items)} fields sent, it has {len(_FIELDS)} ({', '.join(_FIELDS)})"
    at = _AT.search(str(exc))
    name = _FIELDS[int(at.group(1))] if at else "?"
    return f"serve request: field {name}: {exc}"


# -- the control plane's answers ------------------------------------------------------------------------------
# ``ShardInfo``'s fields in order: the first fields of ``Ping``, ``Started`` and ``Description`` (``Ping(*facts, ...)``)
ShardFacts = tuple[int, int, int, str, int, int, dict[str, Any] | None]


class ShardInfo(Record, array_like=True, frozen=True):
    """Who a shard is and what it holds (``EngineShard.ping_info``): its slot and incarnation, stamped weight
    version, state (``new``, ``starting``, ``ready``, ``failed``, ``shut_down``), requests in flight, process id
    and its engine's progress facts (``health.progress.ProgressFacts.as_dict``; None where none are kept)."""

    slot: int
    incarnation: int
    weight_version: int
    state: str
    in_flight: int
    pid: int
    progress: dict[str, Any] | None


class Ping(ShardInfo, array_like=True, frozen=True):
    """``ping``'s answer: ``core_checked`` says whether it speaks for the engine core (False while the core
    runs a bounded worker call: ask again after it)."""

    core_checked: bool


class Started(ShardInfo, array_like=True, frozen=True):
    """``start``'s answer: how long the engine took, whether its backend pauses natively, its node."""

    start_s: float
    native_pause: bool
    node: str | None


class Description(ShardInfo, array_like=True, frozen=True):
    """``describe``'s answer, what a restarted controller re-adopts a shard from: its node, ``dirty`` (a
    transfer touched the weights since the stamp: unknown weights), ``paused``, who holds it paused
    (``refit_hold``: the version of the refit that owns the pause, or None; ``operator_hold``), whether it
    pauses natively, and its gate's counters."""

    node: str | None
    dirty: bool
    paused: bool
    refit_hold: int | None
    operator_hold: bool
    native_pause: bool
    gate: dict[str, Any]


class Left(Record, array_like=True, frozen=True):
    """What a shard held the instant it left the serving set (``EngineShard.set_route``)."""

    in_flight: int
    admitted: int
    epoch: int


class Counters(Record, array_like=True, frozen=True):
    """``counters``' answer: what the shard admitted and refused (by reason), its gate's word (``member``,
    ``floor``, ``committed``, ``cap``), requests in flight and the most held at once, re-sent ids answered
    again (``deduplicated``), tokens its engine made while paused (``sampled_while_paused``: 0 unless
    something unpaused it behind its pause's back), ``left`` and who holds it paused; ``gathered``: watched
    requests started, by the tokens their engine sent per output (``fleet.shard.stream_pace``)."""

    admitted: int
    refused: dict[str, int]
    paused: bool
    member: bool
    floor: int
    committed: int
    cap: int | None
    peak_in_flight: int
    deduplicated: int
    in_flight: int
    slot: int
    incarnation: int
    weight_version: int
    left: Left | None
    sampled_while_paused: int
    refit_hold: int | None
    operator_hold: bool
    gathered: dict[int, int] = msgspec.field(default_factory=dict)


class BeginRefit(Record, array_like=True, frozen=True):
    """``begin_refit``'s answer: requests aborted for the refit's version (their policy forbids it), requests
    still in flight, and, when the call paused the engine too, ``pause``'s acknowledgement (None: not asked)."""

    aborted: int
    in_flight: int
    paused: bool | None = None


class EndRefit(Record, array_like=True, frozen=True):
    """``end_refit``'s answer: the stamp's outcome (``ok``, ``bad_ack``, ``unavailable``, ``error``; None:
    nothing to stamp) and its exception, requests aborted, ``resumed`` (the refit released the engine: True)
    and ``paused_for`` (``operator`` when the operator's ``keep`` pause holds it paused after the refit)."""

    stamp: str | None
    stamp_error: BaseException | None
    aborted: int
    resumed: bool | None
    paused_for: str | None


# -- a peer copy's answers (``fleet.shard.peer_copy``) ----------------------------------------------------------
class PeerManifest(Record, array_like=True, frozen=True):
    """``peer_manifest``'s answer: the engine's parameters as a peer copy moves them, one manifest per
    weight-holding worker in worker order (``refit.peer.manifest``: entries (name, shape, dtype), ``unreadable``,
    ``blocker``), with its stamped ``weight_version`` and ``dirty`` (a transfer touched the weights since)."""

    workers: tuple[dict[str, Any], ...]
    weight_version: int
    dirty: bool


class PeerOffer(Record, array_like=True, frozen=True):
    """``open_donation``'s answer: where the receiver's workers meet the donor's for copy ``copy_id``, one
    address per worker in worker order (``refit.group.GroupAddress``'s wire form), or ``error`` and none."""

    copy_id: int
    addresses: tuple[dict[str, Any], ...]
    error: str | None


class Donated(Record, array_like=True, frozen=True):
    """``donate_weights``'s answer: ``ok`` or ``error``; ``weight_version``: the donor's stamp, which its weights
    were all through the send (else not ok); bytes sent; ``waited_s``: waiting for the receiver to join (its
    engine serving all along); ``held_s``: the send itself, while its engine took no step; ``digests``: one
    ``{parameter: sha256}`` per worker of what was sent (vLLM's ``compute_weight_checksums``; empty when not
    asked or not ok)."""

    ok: bool
    error: str | None
    weight_version: int
    bytes: int
    waited_s: float
    held_s: float
    digests: tuple[dict[str, str], ...]


class PeerReceived(Record, array_like=True, frozen=True):
    """``receive_weights_from_peer``'s answer: ``state`` (``not_started``: no byte written, the shard as it was;
    ``partial``: weights unknown, the shard stays ``dirty``; ``complete``: every parameter is the donor's),
    ``error``, bytes, ``recv_s``, ``load_s`` (vLLM re-deriving from the parameters), ``cache_cleared`` (prefix
    cache blocks computed by the old weights dropped) and ``digests`` after the load, one per worker (empty
    unless complete). Not stamped: the caller compares digests, then stamps (``set_weight_version``)."""

    ok: bool
    state: str
    error: str | None
    bytes: int
    recv_s: float
    load_s: float
    cache_cleared: bool
    digests: tuple[dict[str, str], ...]


class WeightDigests(Record, array_like=True, frozen=True):
    """``weight_digests``' answer: one ``{parameter: sha256}`` per worker (vLLM's ``compute_weight_checksums``),
    and the shard's ``weight_version`` and ``dirty`` when asked."""

    workers: tuple[dict[str, str], ...]
    weight_version: int
    dirty: bool
