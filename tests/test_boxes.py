"""Pieces (tritonreshard.recipes.boxes) and the meta-device load tracer (recipes.metatrace) against
real elements: a loader run on integer-coded tensors (every element says which source element it
is) and the same loader traced on meta tensors must agree element for element once the pieces are
evaluated, and the exact comparison must find a difference exactly where the elements differ, at
the first differing element (row-major), whatever the boxes. No vLLM: loaders written here as
vLLM's are (narrow, select, unbind, transpose, a flattened view, broadcast, padding fills)."""
import random

import pytest
import torch

from tritonreshard.recipes.boxes import FILL, Piece, first_difference, merge_pieces
from tritonreshard.recipes.metatrace import LoadTracer
from tritonreshard.recipes.trace import POISON, encode

SHAPES = {0: (6, 8), 1: (4, 6, 8)}


def _evaluate(pieces, shape):
    """The float64 codes a set of disjoint pieces puts in a tensor of ``shape`` (POISON elsewhere)."""
    out = torch.full(shape, POISON, dtype=torch.float64)
    for p in pieces:
        grids = torch.meshgrid(*[torch.arange(a, b) for a, b in p.box], indexing="ij")
        flat = p.base + sum((g - a) * c for g, (a, _), c in zip(grids, p.box, p.coef, strict=True))
        out[tuple(slice(a, b) for a, b in p.box)] = 0.0 if p.src == FILL else (flat * 2 + p.src * 2 ** 33 + 1).double()
    return out


LOADERS = {
    "narrow rows": ((3, 8), lambda w, s: w.copy_(s[0].narrow(0, 3, 3))),
    "qkv-like blocks": ((5, 8), lambda w, s: (w[:2].copy_(s[0][4:6]), w[2:5].copy_(s[0][0:3]))),
    "transposed": ((8, 6), lambda w, s: w.copy_(s[0].t())),
    "contiguous transpose of a narrow": ((8, 3), lambda w, s: w.copy_(s[0][:, :].narrow(0, 3, 3).t().contiguous())),
    "expert slices": ((4, 3, 8), lambda w, s: [w[e].copy_(s[1][3 - e, 3:6]) for e in range(4)]),
    "unbind": ((2, 6, 8), lambda w, s: [w[i].copy_(t) for i, t in enumerate(s[1].unbind(0)[1:3])]),
    "flattened view": ((48,), lambda w, s: w.copy_(s[0].reshape(-1))),
    "a 3-D view of a 2-D param": ((6, 8), lambda w, s: w.view(2, 3, 8).copy_(s[1][1, :, :].view(2, 3, 8))),
    "broadcast row": ((4, 8), lambda w, s: w.copy_(s[0][2])),
    "padding": ((8, 8), lambda w, s: (w[:6].copy_(s[0]), w[6:].fill_(0))),
    "overwritten": ((6, 8), lambda w, s: (w.zero_(), w[1:4, 2:5].copy_(s[0][0:3, 0:3]))),
    "gpt-oss bias": ((6, 8), lambda w, s: w.copy_(torch.zeros_like(s[0]))),
    "every other row, every third column": ((6, 8), lambda w, s: w[::2, ::3].copy_(s[1][2, 1:4, 5:8])),
    "interleaved halves": ((8, 8), lambda w, s: (w.view(4, 2, 8)[:, 0].copy_(s[0][:4]),
                                                 w.view(4, 2, 8)[:, 1].copy_(s[0][2:6]))),
}


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_traced_pieces_equal_the_real_load(name):
    shape, loader = LOADERS[name]
    with torch.no_grad():
        real = torch.full(shape, POISON, dtype=torch.float64)
        loader(real, {i: encode(i, s) for i, s in SHAPES.items()})
        metas = {i: torch.empty(s, device="meta") for i, s in SHAPES.items()}
        target = torch.empty(shape, device="meta")
        tracer = LoadTracer(metas, {"w": target})
        with tracer:
            loader(target, metas)
    written = tracer.written["w"]
    assert written.undecided is None, written.undecided
    pieces = written.pieces()
    assert torch.equal(_evaluate(pieces, shape), real)
    assert torch.equal(_evaluate(merge_pieces(pieces), shape), real)  # merging keeps every element


def test_what_is_no_copy_or_no_box_is_never_passed():
    metas = {0: torch.empty(6, 8, device="meta")}
    for loader, undecided in ((lambda w, s: w.copy_(s[0] * 2), False), (lambda w, s: w.copy_(torch.cat([s[0]])), False),
                              (lambda w, s: w.copy_(s["v"]), True)):
        target, other = torch.empty(6, 8, device="meta"), torch.empty(6, 8, device="meta")
        tracer = LoadTracer(metas, {"w": target, "v": other})
        with tracer, torch.no_grad():
            loader(target, {**metas, "v": other})
        written = tracer.written["w"]
        assert bool(written.undecided) == undecided
        assert undecided or any(p.src < 0 and p.src != FILL for p in written.pieces())


def _random_pieces(rng, shape, cuts):
    """Disjoint pieces tiling ``shape``: a grid of ``cuts`` per dim, each cell from a random source
    box (sources of SHAPES[0]'s size), sometimes transposed, sometimes a zero fill."""
    edges = [sorted({0, n, *rng.sample(range(1, n), min(cuts, n - 1))}) for n in shape]
    out = []
    for i in range(len(edges[0]) - 1):
        for j in range(len(edges[1]) - 1):
            box = ((edges[0][i], edges[0][i + 1]), (edges[1][j], edges[1][j + 1]))
            if rng.random() < 0.1:
                out.append(Piece.make(box, FILL))
                continue
            coef = rng.choice([(8, 1), (1, 8)])
            out.append(Piece.make(box, rng.randrange(2), rng.randrange(4), coef))
    return out


def test_first_difference_is_exact_on_random_boxes():
    """Two piece sets cut differently: the comparison says equal exactly when the elements are, and
    otherwise names the first differing element (row-major), also where one side writes nothing."""
    rng = random.Random(0)
    shape = (7, 9)
    for trial in range(300):
        a = _random_pieces(rng, shape, 3)
        # The same elements, cut on another grid (each cell re-expressed from a's maps) ...
        fine = [q for p in a for q in _split(rng, p)]
        b = list(fine)
        if trial % 3:  # ... then changed: one cell another source, another map, or left out
            k = rng.randrange(len(b))
            p = b[k]
            change = rng.choice(["src", "base", "coef", "drop"])
            if change == "drop":
                del b[k]
            elif change == "src":
                b[k] = Piece.make(p.box, (p.src + 1) % 2 if p.src >= 0 else 0, p.base, p.coef or (8, 1))
            elif change == "base":
                b[k] = Piece.make(p.box, max(p.src, 0), p.base + 1, p.coef)
            else:
                b[k] = Piece.make(p.box, max(p.src, 0), p.base, (p.coef[1] + 2, p.coef[0] + 3))
        ea, eb = _evaluate(a, shape), _evaluate(b, shape)
        diff = first_difference(a, b)
        if torch.equal(ea, eb):
            assert diff is None, (trial, diff)
        else:
            first = tuple((ea != eb).nonzero()[0].tolist())
            assert diff is not None and diff[0] == first, (trial, diff, first)


def _split(rng, p):
    """``p`` cut in two along a random dim where it is wider than one (the same elements)."""
    dims = [k for k, (a, b) in enumerate(p.box) if b - a > 1]
    if not dims:
        return [p]
    k = rng.choice(dims)
    a, b = p.box[k]
    m = rng.randrange(a + 1, b)
    return [p.clip(p.box[:k] + ((a, m),) + p.box[k + 1:]), p.clip(p.box[:k] + ((m, b),) + p.box[k + 1:])]
