"""Rank <-> mesh coordinate, the row-major numbering DeviceMesh uses: the tests' reference."""


def coords(rank: int, mesh_shape) -> list[int]:
    """Mesh coordinate of `rank` on a mesh of `mesh_shape`."""
    out = []
    for s in reversed(mesh_shape):
        out.append(rank % s)
        rank //= s
    return out[::-1]
