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

Completeness (``validate``): an update carries every weight the model's checkpoint
holds, unless the sender declares what it leaves out (``partial``: anything it does
not send; ``frozen``: names or ``fnmatch`` patterns). What is left out stays exactly
as it is on the engines; a decoder layer is sent whole or left out whole, because
vLLM loads several checkpoint tensors into one parameter (q/k/v -> ``qkv_proj``,
gate/up -> ``gate_up_proj``) and a half-loaded one would be undefined.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from rlfleet.refit import delta
from rlfleet.refit.errors import ManifestError

TRANSFERS = ("bucketed", "per_tensor")
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
# Checkpoint tensors vLLM never loads (buffers it recomputes): an update need not carry them.
_NOT_LOADED = re.compile(r"\.rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
MAX_SHOWN = 6  # problems / names shown in one refusal message

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
    """Every tensor of one update, bucketed. Build with ``plan_buckets``; ship with ``to_wire``.

    ``partial`` / ``frozen`` declare what the sender leaves out on purpose (see the module
    docstring); ``aliases`` are (name, sent name) pairs of tied tensors sent once.
    """

    transfer: str
    buckets: tuple[Bucket, ...]
    partial: bool = False
    frozen: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    # A delta (``refit.delta``): the tensors sent as patches or left unchanged, with their full shapes; their
    # entries are ``<name>#delta_idx`` / ``<name>#delta_val`` (none when nothing changed). ``base``: the token of
    # the weights the patches apply to; ``result``: the token of the weights this update leaves (None: untracked).
    patches: tuple[tuple[str, tuple[int, ...]], ...] = ()
    base: str | None = None
    result: str | None = None
    # The sender's ``refit.checksum.tensor_digest`` (hex) of each patched tensor's new whole value, when asked
    # (``prepare(digests=True)``): what an engine's record of its weights says after the patches.
    patched_digests: tuple[tuple[str, str], ...] = ()

    def leaves_out(self, name: str) -> bool:
        """True if the sender declared that ``name`` may be absent (the engines keep it as it is)."""
        return self.partial or any(fnmatch.fnmatchcase(name, p) for p in self.frozen)

    @property
    def entries(self) -> list[TensorEntry]:
        return [e for b in self.buckets for e in b.entries]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def weight_names(self) -> list[str]:
        """The model's tensors this update sets: those sent whole and those patched (or left unchanged)."""
        return [n for n in self.names if delta.split_name(n) is None] + [n for n, _ in self.patches]

    @property
    def is_delta(self) -> bool:
        return self.base is not None

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
            "partial": self.partial,
            "frozen": list(self.frozen),
            "aliases": [list(a) for a in self.aliases],
            **({"patches": [[n, list(sh)] for n, sh in self.patches], "base": self.base} if self.is_delta else {}),
            **({"patched_digests": [list(d) for d in self.patched_digests]} if self.patched_digests else {}),
            **({"result": self.result} if self.result is not None else {}),
        }

    @classmethod
    def from_wire(cls, wire: Mapping) -> "Manifest":
        try:
            buckets = tuple(
                Bucket(i, dtype_name(dt), int(n), int(so), tuple(TensorEntry(str(nm), tuple(int(s) for s in sh), dtype_name(dt), int(off), int(ne)) for nm, sh, off, ne in ents))
                for i, (dt, n, so, ents) in enumerate(wire["buckets"])
            )
            m = cls(
                str(wire["transfer"]), buckets,
                partial=bool(wire.get("partial", False)),
                frozen=tuple(str(p) for p in wire.get("frozen", ())),
                aliases=tuple((str(a), str(b)) for a, b in wire.get("aliases", ())),
                patches=tuple((str(n), tuple(int(x) for x in sh)) for n, sh in wire.get("patches", ())),
                base=None if wire.get("base") is None else str(wire["base"]),
                result=None if wire.get("result") is None else str(wire["result"]),
                patched_digests=tuple((str(n), str(d)) for n, d in wire.get("patched_digests", ())),
            )
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
        self._check_patches(seen)
        for alias, target in self.aliases:
            if target not in seen and target not in dict(self.patches) or alias in seen:
                raise ManifestError(f"alias {alias!r} -> {target!r} must name a tensor of the update under a name it does not use")


    def _check_patches(self, seen: set[str]) -> None:
        """A patch's two entries come together, one index per value, 1-D; a patched tensor is not also sent whole."""
        if self.patches and self.base is None:
            raise ManifestError("an update with patches must name the base they apply to")
        sizes = {e.name: e for e in self.entries}
        patched = dict(self.patches)
        if len(patched) != len(self.patches):
            raise ManifestError("a tensor is patched twice in the update")
        for name in self.names:
            split = delta.split_name(name)
            if split is not None and split[0] not in patched:
                raise ManifestError(f"entry {name!r} belongs to no patch of the update")
        if not dict(self.patched_digests).keys() <= patched.keys():
            raise ManifestError("a patched digest names a tensor the update does not patch")
        for name, shape in self.patches:
            idx, val = sizes.get(delta.idx_name(name)), sizes.get(delta.val_name(name))
            if name in seen:
                raise ManifestError(f"tensor {name!r} is both patched and sent whole")
            if (idx is None) != (val is None):
                raise ManifestError(f"patch of {name!r} lacks its {'values' if val is None else 'indices'}")
            if idx is not None and val is not None:
                if len(idx.shape) != 1 or idx.shape != val.shape or idx.numel > math.prod(shape):
                    raise ManifestError(f"patch of {name!r}: {idx.numel} indices and {val.numel} values for a "
                                        f"tensor of shape {shape}")
                if idx.dtype not in ("int32", "int64"):
                    raise ManifestError(f"patch of {name!r}: indices are {idx.dtype}, not int32 or int64")


def plan_buckets(
    specs: Iterable[tuple[str, Sequence[int], object]], bucket_bytes: int, transfer: str = "bucketed", direct_bytes: int | None = None,
    **fields,
) -> Manifest:
    """Lay tensors ``(name, shape, dtype)`` into buckets. See the module docstring for the guarantees.

    Tensors of at least ``direct_bytes`` get a bucket of their own (the sender can then
    broadcast them straight from their storage, without packing). ``fields``: the manifest's other fields
    (``partial``, ``frozen``, ``aliases``, ``patches``, ``base``, ``result``, ``patched_digests``).
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
    manifest = Manifest(transfer, tuple(buckets), **fields)
    manifest.check_layout()
    return manifest


# -- validation against the receiving model -------------------------------------------

ExpectedSpec = Mapping[str, tuple[tuple[int, ...], str]]


def validate(manifest: Manifest, expected: ExpectedSpec | None, engine_dtype: str | None) -> None:
    """Raise ``ManifestError`` naming every tensor (up to ``MAX_SHOWN``) that does not fit the model.

    ``expected`` maps checkpoint (Hugging Face) names to (shape, checkpoint dtype);
    ``None`` means the model's checkpoint layout is unknown and only dtypes are checked.
    Floating tensors must arrive in ``engine_dtype`` (the dtype the engine runs);
    other dtypes must match the checkpoint. Every weight of ``expected`` must be in
    the update unless the manifest declares it left out, and a decoder layer is
    updated whole (see ``layer_group``).
    """
    manifest.check_layout()
    if not manifest.buckets:
        raise ManifestError("the update holds no tensors")
    problems = [p for p in (_entry_problem(e, expected, engine_dtype) for e in manifest.entries
                            if delta.split_name(e.name) is None) if p]
    problems += [p for p in (_patch_problem(n, sh, manifest, expected, engine_dtype) for n, sh in manifest.patches) if p]
    if expected is not None and not problems:
        problems = _completeness_problems(manifest, expected)
    if problems:
        more = f"; and {len(problems) - MAX_SHOWN} more problems" if len(problems) > MAX_SHOWN else ""
        raise ManifestError("; ".join(problems[:MAX_SHOWN]) + more)


def _entry_problem(e: TensorEntry, expected: ExpectedSpec | None, engine_dtype: str | None) -> str | None:
    want = expected.get(e.name) if expected is not None else None
    if expected is not None and want is None:
        close = difflib.get_close_matches(e.name, list(expected), n=1)
        return f"tensor {e.name}: not a weight of this model" + (f" (closest: {close[0]})" if close else "")
    if want is not None and tuple(want[0]) != e.shape:
        return f"tensor {e.name}: shape {e.shape}, engine expects {tuple(want[0])}"
    floating = e.dtype in ("float32", "float64", "float16", "bfloat16")
    if floating and engine_dtype is not None and e.dtype != engine_dtype:
        return f"tensor {e.name}: dtype {e.dtype}, engine expects {engine_dtype} (the sender casts with WeightSender(dtype=...))"
    if not floating and want is not None and e.dtype != want[1]:
        return f"tensor {e.name}: dtype {e.dtype}, engine expects {want[1]}"
    return None


def _patch_problem(name: str, shape: tuple[int, ...], manifest: Manifest, expected: ExpectedSpec | None,
                   engine_dtype: str | None) -> str | None:
    """A patch checked as the whole tensor it writes: a weight of the model, of its shape, values in the engine's dtype."""
    vals = next((e for e in manifest.entries if e.name == delta.val_name(name)), None)
    whole = TensorEntry(name, shape, vals.dtype if vals is not None else (engine_dtype or "float32"), 0, math.prod(shape))
    problem = _entry_problem(whole, expected, engine_dtype)
    if problem is None and whole.dtype not in ("float32", "float64", "float16", "bfloat16"):
        problem = f"tensor {name}: a patch needs floating values, got {whole.dtype}"
    return problem


def _completeness_problems(manifest: Manifest, expected: ExpectedSpec) -> list[str]:
    """Missing weights the sender did not declare, and decoder layers the update would tear."""
    required = sorted(n for n in expected if not _NOT_LOADED.search(n))
    carried = set(manifest.weight_names) | {alias for alias, _ in manifest.aliases}
    absent = [n for n in required if n not in carried]
    undeclared = [n for n in absent if not manifest.leaves_out(n)]
    problems = []
    if undeclared:
        problems.append(
            f"missing tensors: {_name_groups(undeclared, required)}; an update carries every weight of the model "
            "unless the sender declares a partial update (WeightSender(partial=True) or WeightSender(frozen=[...]))"
        )
    touched = {layer_group(n) for n in manifest.weight_names}
    torn = [n for n in absent if n not in undeclared and layer_group(n) in touched]
    if torn:
        layers = sorted({layer_group(n) for n in torn})
        problems.append(
            f"update touches {', '.join(layers)} but leaves out {_name_groups(torn, required)}; a decoder layer is sent "
            "whole or left out whole (vLLM loads q/k/v into one qkv_proj and gate/up into one gate_up_proj)"
        )
    return problems


def _name_groups(names: Sequence[str], required: Sequence[str]) -> str:
    """``model.layers.1.* (9 tensors)`` for a whole layer, the names themselves otherwise; at most ``MAX_SHOWN`` items."""
    size: dict[str, int] = {}
    for n in required:
        size[layer_group(n)] = size.get(layer_group(n), 0) + 1
    by_group: dict[str, list[str]] = {}
    for n in names:
        by_group.setdefault(layer_group(n), []).append(n)
    items: list[str] = []
    for group, members in by_group.items():
        whole = len(members) == size.get(group) and len(members) > 1
        items.extend([f"{group}.* ({len(members)} tensors)"] if whole else members)
    more = f", ... ({len(items) - MAX_SHOWN} more)" if len(items) > MAX_SHOWN else ""
    return ", ".join(items[:MAX_SHOWN]) + more
