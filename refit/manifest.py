"""The metadata of one weight update: which tensors, in which buckets, at which offsets.

Pure data and pure functions (torch is used only for dtype names and sizes). The
manifest travels as plain data through the control RPC, never through the process
group: receivers validate it against their model *before* any byte moves, so a
wrong name, shape or dtype is rejected with nothing changed.

Layout guarantees of ``plan_buckets``:

- one dtype per bucket; tensors keep their input order within a dtype;
- a bucket holds at most ``bucket_bytes`` unless a single tensor is larger, in which
  case that tensor travels alone in a bucket of its own size; tensors of at least
  ``direct_bytes`` also travel alone (sent from their own storage, no packing);
- buckets of one dtype are laid end to end (``staging_offset``), so a receiver can
  receive every bucket straight into one reused staging buffer per dtype;
- ``per_tensor`` transfer is the same structure with one tensor per bucket.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from refit.errors import ManifestError

TRANSFERS = ("bucketed", "per_tensor")
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")

_DTYPE_SIZES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``; strings pass through after a check."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ManifestError(f"dtype {name!r} cannot be transferred; supported: {sorted(_DTYPE_SIZES)}")
    return name


def dtype_size(name: str) -> int:
    return _DTYPE_SIZES[dtype_name(name)]


def layer_group(name: str) -> str:
    """The unit that must be updated whole: a decoder layer (``model.layers.3``) or a top-level tensor.

    vLLM fuses several checkpoint tensors of one layer into one parameter (q/k/v ->
    qkv_proj, gate/up -> gate_up_proj); loading only some of them leaves the rest of
    the fused parameter undefined. Whole decoder layers are always safe.
    """
    m = _LAYER.match(name)
    return m.group(1) if m else name


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # element offset inside its bucket
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: str
    numel: int
    staging_offset: int  # element offset of this bucket inside the staging area of its dtype
    entries: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


@dataclass(frozen=True)
class Manifest:
    """Every tensor of one update, bucketed. Build with ``plan_buckets``; ship with ``to_wire``."""

    transfer: str
    buckets: tuple[Bucket, ...]

    @property
    def entries(self) -> list[TensorEntry]:
        return [e for b in self.buckets for e in b.entries]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def staging_numel(self) -> dict[str, int]:
        """Elements of the staging area each dtype needs (all buckets of that dtype end to end)."""
        out: dict[str, int] = {}
        for b in self.buckets:
            out[b.dtype] = max(out.get(b.dtype, 0), b.staging_offset + b.numel)
        return out

    def max_bucket_numel(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buckets:
            out[b.dtype] = max(out.get(b.dtype, 0), b.numel)
        return out

    def to_wire(self) -> dict:
        """Plain data (str/int/list) that survives any RPC serializer."""
        return {
            "transfer": self.transfer,
            "buckets": [
                [b.dtype, b.numel, b.staging_offset, [[e.name, list(e.shape), e.offset, e.numel] for e in b.entries]]
                for b in self.buckets
            ],
        }

    @classmethod
    def from_wire(cls, wire: Mapping) -> "Manifest":
        try:
            buckets = tuple(
                Bucket(i, dtype_name(dt), int(n), int(so), tuple(TensorEntry(str(nm), tuple(int(s) for s in sh), dtype_name(dt), int(off), int(ne)) for nm, sh, off, ne in ents))
                for i, (dt, n, so, ents) in enumerate(wire["buckets"])
            )
            m = cls(str(wire["transfer"]), buckets)
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from None
        m.check_layout()
        return m

    def digest(self) -> int:
        """A 62-bit fingerprint of the wire form; sent in the stream header so ranks detect misalignment."""
        raw = json.dumps(self.to_wire(), separators=(",", ":")).encode()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 2

    def check_layout(self) -> None:
        """Internal consistency: offsets inside buckets, sizes that match shapes, no duplicate names."""
        if self.transfer not in TRANSFERS:
            raise ManifestError(f"unknown transfer {self.transfer!r}; allowed: {TRANSFERS}")
        seen: set[str] = set()
        for b in self.buckets:
            for e in b.entries:
                if e.name in seen:
                    raise ManifestError(f"tensor {e.name!r} appears twice in the update")
                seen.add(e.name)
                if e.numel != math.prod(e.shape):
                    raise ManifestError(f"tensor {e.name!r}: numel {e.numel} does not match shape {e.shape}")
                if e.offset < 0 or e.offset + e.numel > b.numel:
                    raise ManifestError(f"tensor {e.name!r} lies outside bucket {b.index} ({b.numel} elements)")


def plan_buckets(
    specs: Iterable[tuple[str, Sequence[int], object]], bucket_bytes: int, transfer: str = "bucketed", direct_bytes: int | None = None
) -> Manifest:
    """Lay tensors ``(name, shape, dtype)`` into buckets. See the module docstring for the guarantees.

    Tensors of at least ``direct_bytes`` get a bucket of their own (the sender can then
    broadcast them straight from their storage, without packing).
    """
    if transfer not in TRANSFERS:
        raise ManifestError(f"unknown transfer {transfer!r}; allowed: {TRANSFERS}")
    if bucket_bytes <= 0:
        raise ManifestError(f"bucket size must be positive, got {bucket_bytes} bytes")
    by_dtype: dict[str, list[tuple[str, tuple[int, ...], int]]] = {}
    for name, shape, dtype in specs:
        shape = tuple(int(s) for s in shape)
        by_dtype.setdefault(dtype_name(dtype), []).append((name, shape, math.prod(shape)))
    buckets: list[Bucket] = []
    for dt, items in by_dtype.items():
        limit = max(1, bucket_bytes // dtype_size(dt))
        staging = 0
        current: list[TensorEntry] = []
        fill = 0

        def close() -> None:
            nonlocal staging, current, fill
            if current:
                buckets.append(Bucket(len(buckets), dt, fill, staging, tuple(current)))
                staging += fill
                current, fill = [], 0

        direct = limit if direct_bytes is None else max(1, direct_bytes // dtype_size(dt))
        for name, shape, numel in items:
            alone = transfer == "per_tensor" or numel >= direct
            if current and (alone or fill + numel > limit):
                close()
            current.append(TensorEntry(name, shape, dt, fill, numel))
            fill += numel
            if alone:
                close()
        close()
    manifest = Manifest(transfer, tuple(buckets))
    manifest.check_layout()
    return manifest


# -- validation against the receiving model -------------------------------------------

ExpectedSpec = Mapping[str, tuple[tuple[int, ...], str]]


def validate(manifest: Manifest, expected: ExpectedSpec | None, engine_dtype: str | None) -> None:
    """Raise ``ManifestError`` naming the first tensor that does not fit the model.

    ``expected`` maps checkpoint (Hugging Face) names to (shape, checkpoint dtype);
    ``None`` means the model's checkpoint layout is unknown and only dtypes are checked.
    Floating tensors must arrive in ``engine_dtype`` (the dtype the engine runs);
    other dtypes must match the checkpoint. Every layer the update touches must be
    complete (see ``layer_group``).
    """
    manifest.check_layout()
    if not manifest.buckets:
        raise ManifestError("the update holds no tensors")
    for e in manifest.entries:
        want = expected.get(e.name) if expected is not None else None
        if expected is not None and want is None:
            close = difflib.get_close_matches(e.name, list(expected), n=1)
            hint = f" (closest model tensor: {close[0]!r})" if close else ""
            raise ManifestError(f"tensor {e.name!r} is not a weight of this model{hint}")
        if want is not None and tuple(want[0]) != e.shape:
            raise ManifestError(f"tensor {e.name!r} has shape {list(e.shape)} in the update but {list(want[0])} in the model")
        floating = e.dtype in ("float32", "float64", "float16", "bfloat16")
        if floating and engine_dtype is not None and e.dtype != engine_dtype:
            raise ManifestError(f"tensor {e.name!r} has dtype {e.dtype} in the update but the engine runs {engine_dtype}")
        if not floating and want is not None and e.dtype != want[1]:
            raise ManifestError(f"tensor {e.name!r} has dtype {e.dtype} in the update but {want[1]} in the model")
    if expected is not None:
        _check_whole_layers(manifest.names, expected)


def _check_whole_layers(names: Sequence[str], expected: ExpectedSpec) -> None:
    touched = {layer_group(n) for n in names}
    present = set(names)
    for group in sorted(touched):
        missing = sorted(n for n in expected if layer_group(n) == group and n not in present)
        if missing:
            shown = ", ".join(repr(m) for m in missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise ManifestError(f"update touches {group!r} but lacks its tensors {shown}; a layer must be updated whole")
