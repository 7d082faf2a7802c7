"""Layout = placements (one per mesh dim) + shard order (per sharded tensor dim, the mesh dims that
split it, in split order).

The planner uses layouts as graph nodes and the ILP as dict keys in hot loops, so a Layout is a
small immutable value with a precomputed hash, built from our own tiny `Placement` tuples rather
than torch placement objects. Conversion to torch (`DTensorSpec` with `shard_order`, or the
physical `_StridedShard` encoding) happens only at the edges.

Text form: placements concatenated, then one `[a,b,...]` per tensor dim sharded over 2+ mesh dims,
in tensor-dim order, always printed: `S(0)S(0)[1,0]` = tensor dim 0 split first over mesh dim 1,
then over mesh dim 0. `RS(0)`, `PP`, `P(avg)R`. Parsing also accepts `S(0)S(0) order (1,0)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from autoshard import _torch_compat as tc

REDUCE_OPS = ("sum", "avg")

Order = tuple[tuple[int, tuple[int, ...]], ...]


class Placement(NamedTuple):
    """One mesh dim's placement: kind "R" (replicate), "S" (shard tensor dim `dim`) or "P"
    (partial, pending reduction `op`)."""

    kind: str
    dim: int = -1
    op: str = ""

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim})"
        if self.kind == "P":
            return "P" if self.op == "sum" else f"P({self.op})"
        return "R"

    __repr__ = __str__


R = Placement("R")


def S(dim: int) -> Placement:
    if not isinstance(dim, int) or dim < 0:
        raise ValueError(f"shard dim must be a non-negative int, got {dim!r}")
    return Placement("S", dim)


def P(op: str = "sum") -> Placement:
    if op not in REDUCE_OPS:
        raise ValueError(f"unsupported partial reduce op {op!r}; supported: {REDUCE_OPS}")
    return Placement("P", -1, op)


@dataclass(frozen=True, slots=True)
class Layout:
    placements: tuple[Placement, ...]
    order: Order = None  # type: ignore[assignment]  # normalized in __post_init__
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        placements = tuple(self.placements)
        for p in placements:
            if not isinstance(p, Placement) or not _valid(p):
                raise ValueError(f"placements must be autoshard Placement values (R, S(d), P(op)), got {p!r}")
        order = _normalize_order(placements, self.order)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "_hash", hash((placements, order)))

    @classmethod
    def _raw(cls, placements: tuple[Placement, ...], order: Order) -> Layout:
        """Trusted constructor for the planner's inner loop (inputs already normalized)."""
        self = object.__new__(cls)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "_hash", hash((placements, order)))
        return self

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # recompute the hash on unpickling: string hashes differ between processes
        return Layout._raw, (self.placements, self.order)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout) or self._hash != other._hash:
            return False
        return self.placements == other.placements and self.order == other.order

    def __str__(self) -> str:
        text = "".join(str(p) for p in self.placements)
        return text + "".join(f"[{','.join(map(str, mds))}]" for _, mds in self.order if len(mds) > 1)

    def __repr__(self) -> str:
        return f"Layout({str(self)!r})"

    # ----------------------------------------------------------------- construction
    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse `S(0)S(0)[1,0]`, `S(0)S(0) order (1,0)`, `RS(0)`, `P(avg)R`, ..."""
        return _parse(text)

    @classmethod
    def replicate(cls, mesh_ndim: int) -> Layout:
        return cls((R,) * mesh_ndim)

    def with_order(self, order: Mapping[int, Sequence[int]] | Sequence[tuple[int, Sequence[int]]]) -> Layout:
        """Same placements, with the given split orders (tensor dims not named keep theirs)."""
        merged = dict(self.order)
        items = order.items() if isinstance(order, Mapping) else order
        for td, mds in items:
            if td not in merged:
                raise ValueError(f"tensor dim {td} is not sharded in {self}; cannot give it an order")
            merged[td] = tuple(mds)
        return Layout(self.placements, tuple(merged.items()))

    # ----------------------------------------------------------------- queries
    @property
    def mesh_ndim(self) -> int:
        return len(self.placements)

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        return tuple(td for td, _ in self.order)

    @property
    def is_default_order(self) -> bool:
        return all(list(mds) == sorted(mds) for _, mds in self.order)

    def validate(self, tensor_ndim: int, mesh_shape: Sequence[int]) -> None:
        """Raise ValueError if this layout cannot describe a rank-`tensor_ndim` tensor on a mesh
        of `mesh_shape`."""
        if len(mesh_shape) != self.mesh_ndim:
            raise ValueError(f"layout {self} has {self.mesh_ndim} mesh dims but the mesh is {tuple(mesh_shape)}")
        for td, _ in self.order:
            if td >= tensor_ndim:
                raise ValueError(f"layout {self} shards tensor dim {td}, out of range for a rank-{tensor_ndim} tensor")

    def local_shape(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """Each rank's shard shape. Only even splits are supported (DTensor's uneven chunking is
        not): a tensor dim not divisible by the product of its mesh sizes raises ValueError."""
        self.validate(len(global_shape), mesh_shape)
        shape = list(global_shape)
        for td, mds in self.order:
            n = math.prod([mesh_shape[m] for m in mds])
            if shape[td] % n:
                sizes = [mesh_shape[m] for m in mds]
                raise ValueError(
                    f"layout {self}: tensor dim {td} of size {shape[td]} is not divisible by "
                    f"{n} (mesh dims {list(mds)} of sizes {sizes}); uneven sharding is not supported"
                )
            shape[td] //= n
        return tuple(shape)

    def shard_of(self, full: Any, mesh_shape: Sequence[int], coord: Sequence[int]) -> Any:
        """The shard of the global tensor `full` that the rank at mesh coordinate `coord` holds:
        each sharded tensor dim split over its mesh dims in order (partial dims hold the whole)."""
        self.local_shape(tuple(full.shape), mesh_shape)  # validates even splits
        out = full
        for td, mds in self.order:
            for m in mds:
                size = out.shape[td] // mesh_shape[m]
                out = out.narrow(td, coord[m] * size, size)
        return out

    # ----------------------------------------------------------------- torch conversion
    def _plain_torch_placements(self) -> tuple[Any, ...]:
        out = []
        for p in self.placements:
            if p.kind == "S":
                out.append(tc.Shard(p.dim))
            elif p.kind == "P":
                out.append(tc.Partial(p.op))
            else:
                out.append(tc.Replicate())
        return tuple(out)

    def to_torch_placements(self, mesh: Any) -> tuple[Any, ...]:
        """Physical torch placements: plain Shard where the order is default, `_StridedShard`
        (torch's own encoding) where it is not. `mesh` is a DeviceMesh or a mesh shape."""
        plain = self._plain_torch_placements()
        if self.is_default_order:
            return plain
        mesh_shape = tuple(mesh.shape) if hasattr(mesh, "shape") else tuple(mesh)
        return tc.strided_placements(self.order, plain, mesh_shape)

    def to_spec(self, mesh: Any, tensor_meta: Any = None) -> Any:
        """A torch `DTensorSpec` with explicit `shard_order`."""
        shard_order = tuple(tc.ShardOrderEntry(td, mds) for td, mds in self.order)
        return tc.DTensorSpec(mesh, self._plain_torch_placements(), tensor_meta=tensor_meta, shard_order=shard_order)

    @classmethod
    def from_spec(cls, spec: Any) -> Layout:
        """From a `DTensorSpec` (explicit `shard_order` or `_StridedShard`-encoded)."""
        placements, order = tc.spec_to_order(spec)
        ours = []
        for p in placements:  # exact types: subclasses such as _MaskPartial mean something else
            if type(p) is tc.Shard:
                ours.append(S(p.dim))
            elif type(p) is tc.Partial and p.reduce_op in REDUCE_OPS:
                ours.append(P(p.reduce_op))
            elif type(p) is tc.Replicate:
                ours.append(R)
            else:
                raise ValueError(f"unsupported torch placement {p!r} in {spec}")
        return cls(tuple(ours), order)


def split_digits(index: int, sizes: Sequence[int]) -> list[int]:
    """The coordinates on mesh dims of `sizes` of piece `index` of a tensor dim they split in that
    order (the first split most significant)."""
    out = []
    for size in reversed(sizes):
        out.append(index % size)
        index //= size
    return out[::-1]


def _valid(p: Placement) -> bool:
    if p.kind == "S":
        return isinstance(p.dim, int) and p.dim >= 0 and p.op == ""
    if p.kind == "P":
        return p.dim == -1 and p.op in REDUCE_OPS
    return p == R


def _normalize_order(placements: tuple[Placement, ...], order: Any) -> Order:
    sharded: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if p.kind == "S":
            sharded.setdefault(p.dim, []).append(m)
    given: dict[int, tuple[int, ...]] = {}
    if order is not None:
        text = "".join(str(p) for p in placements)
        items = order.items() if isinstance(order, Mapping) else order
        for td, mds in items:
            mds = tuple(mds)
            if td in given:
                raise ValueError(f"order for tensor dim {td} given twice for {text}")
            if td not in sharded:
                raise ValueError(f"order names tensor dim {td}, which no mesh dim shards in {text}")
            if sorted(mds) != sharded[td]:
                raise ValueError(
                    f"order {list(mds)} for tensor dim {td} must list exactly the mesh dims that "
                    f"shard it in {text}: {sharded[td]} in some order"
                )
            given[td] = mds
    return tuple((td, given.get(td, tuple(mds))) for td, mds in sorted(sharded.items()))


_TOKEN = re.compile(
    r"\s*(?:(?P<R>R)|S\((?P<S>-?\d+)\)|P(?:\((?P<P>\w+)\))?|\[(?P<br>[\d,\s]*)\]"
    r"|(?P<kw>order)|\((?P<tup>[\d,\s]*)\))"
)


def _parse(text: str) -> Layout:
    placements: list[Placement] = []
    orders: list[tuple[int, ...]] = []
    style = None  # "[]" or "order"
    pos, end = 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"bad layout text {text!r}: cannot parse at {text[pos:]!r}")
        pos = m.end()
        if m["R"] or m["S"] is not None or m.group(0).strip().startswith("P"):
            if orders or style:
                raise ValueError(f"bad layout text {text!r}: placements must come before the order")
            if m["R"]:
                placements.append(R)
            elif m["S"] is not None:
                if int(m["S"]) < 0:
                    raise ValueError(f"bad layout text {text!r}: negative shard dims are not supported")
                placements.append(S(int(m["S"])))
            else:
                placements.append(P(m["P"] or "sum"))
        elif m["kw"]:
            if style:
                raise ValueError(f"bad layout text {text!r}: give the order once, as [..] or 'order (..)'")
            style = "order"
        else:
            if m["br"] is not None:
                if style == "order":
                    raise ValueError(f"bad layout text {text!r}: mixes '[..]' and 'order (..)' forms")
                style = "[]"
            elif style != "order":
                raise ValueError(f"bad layout text {text!r}: a '(..)' order must follow 'order'")
            body = m["br"] if m["br"] is not None else m["tup"]
            try:
                orders.append(tuple(int(x) for x in body.split(",")))
            except ValueError:
                raise ValueError(f"bad layout text {text!r}: bad order {body!r}") from None
    if not placements:
        raise ValueError(f"bad layout text {text!r}: no placements")
    if style == "order" and not orders:
        raise ValueError(f"bad layout text {text!r}: 'order' needs at least one (..) tuple")
    default = Layout(tuple(placements))
    multi = [td for td, mds in default.order if len(mds) > 1]
    if orders and len(orders) != len(multi):
        raise ValueError(
            f"bad layout text {text!r}: {len(orders)} order annotation(s) given but tensor dims "
            f"{multi} are sharded over 2+ mesh dims (give one per such dim, in tensor-dim order)"
        )
    return Layout(default.placements, tuple(zip(multi, orders)))
