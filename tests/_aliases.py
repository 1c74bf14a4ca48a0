"""Hypothesis helpers for aliased sources (copies of one tensor under other names, other ranks)."""
import torch
from hypothesis import strategies as st

from tritonreshard import Layout, Replicate


def alias_copy(draw, lay: Layout, fresh, reps=(1, 1, 2)) -> Layout:
    """A copy of ``lay`` split alike: the same placements (after an optional leading replicated
    mesh dim, ``reps`` copies of each region), each mesh position on a fresh rank (``next(fresh)``)
    or, sometimes, on the rank that holds that position in ``lay`` (a rank holding both copies holds
    the same region)."""
    reps = draw(st.sampled_from(reps))
    ranks = []
    for i in range(reps * len(lay.ranks)):
        same = lay.ranks[i % len(lay.ranks)]
        ranks.append(same if same not in ranks and draw(st.integers(0, 3)) == 0 else next(fresh))
    mesh = torch.tensor(ranks).reshape((reps, *lay.mesh_shape) if reps > 1 else lay.mesh_shape).tolist()
    return Layout(lay.shape, mesh, ([Replicate()] if reps > 1 else []) + list(lay.placements), lay.dtype)
