"""``transport.delta.encode`` against the codec written out plainly (single process, a few seconds).

:func:`_reference` builds every encoding of the module docstring in full with Python ints and
``struct`` (the changed positions, the gap fillers one by one, the int8 differences with their
escapes) and takes the smallest, ties to the lower kind. ``encode`` must give the same kind, sizes,
entries and payload bytes, whatever path computed them: on CPU, numpy over chunks of the message
(``kernels.delta.TorchDeltaScan``; chunks of a few words here, so that every message spans many,
some compacted while scanned, some left for later) and a DENSE decided before compacting."""
import struct
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonreshard import kernels
from tritonreshard.transport import delta as D

_FMT = {1: "B", 2: "h", 4: "i", 8: "q"}   # the words as encode reads them (1 byte unsigned, else signed)


def _pad(b: bytes) -> bytes:
    return b + bytes(-len(b) % 8)


def _reference(new: torch.Tensor, old: torch.Tensor, word: int, force_sparse: bool = False,
               kind: int | None = None) -> tuple[int, int, int, int, bytes | None]:
    """``(kind, nbytes, changed, entries, payload)`` of the codec's definition (payload None for DENSE)."""
    n = new.numel() // word
    a = struct.unpack(f"<{n}{_FMT[word]}", new.numpy().tobytes())
    b = struct.unpack(f"<{n}{_FMT[word]}", old.numpy().tobytes())
    pos = [i for i in range(n) if a[i] != b[i]]
    built = {}
    for where in (D.BITMASK, D.INDEX32, D.GAP16, D.GAP8):
        ent = pos
        if where == D.BITMASK:
            bits = bytearray(-(-n // 8))
            for p in pos:
                bits[p // 8] |= 1 << (p % 8)
            section = bytes(bits)
        elif where == D.INDEX32:
            section = struct.pack(f"<{len(pos)}i", *pos)
        else:
            top, fmt = (65535, "H") if where == D.GAP16 else (255, "B")
            ent, prev = [], -1
            for p in pos:
                while p - prev > top:          # a filler on an unchanged word, top words on
                    prev += top
                    ent.append(prev)
                ent.append(p)
                prev = p
            section = struct.pack(f"<{len(ent)}{fmt}", *(ent[i] - (ent[i - 1] if i else -1) for i in range(len(ent))))
        section = _pad(section)
        built[where] = (section + struct.pack(f"<{len(ent)}{_FMT[word]}", *(a[e] for e in ent)), len(ent))
        if word in (2, 4):
            diffs = [a[e] - b[e] for e in ent]
            fits = [-127 <= d <= 127 for d in diffs]
            d8 = struct.pack(f"<{len(ent)}b", *(d if f else -128 for d, f in zip(diffs, fits, strict=True)))
            esc = [a[e] for e, f in zip(ent, fits, strict=True) if not f]
            built[where | D.DIFF8] = (section + _pad(d8) + struct.pack(f"<{len(esc)}{_FMT[word]}", *esc), len(ent))
    if kind is None:
        sizes = {k: len(p) for k, (p, _) in built.items()}
        if not force_sparse:
            sizes[D.DENSE] = n * word
        kind = min(sizes, key=lambda k: (sizes[k], k))
    if kind == D.DENSE:
        return D.DENSE, n * word, len(pos), 0, None
    payload, entries = built[kind]
    return kind, len(payload), len(pos), entries, payload


def _check(new, old, word, **kw):
    want = _reference(new, old, word, **kw)
    enc = D.encode(new, old, word, **kw)
    payload = None if enc.payload is None else enc.payload.numpy().tobytes()
    got = (enc.kind, enc.nbytes, enc.changed, enc.entries, payload)
    assert got[:4] == want[:4], (D.KINDS[got[0]], D.KINDS[want[0]], got[:4], want[:4])
    assert got[4] == want[4], D.KINDS[want[0]]
    return enc


_MODES = ("ulp", "small", "edge", "far", "wrap")


def _message(word: int, n: int, seed: int, segments) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new, old)``: random words, then per segment of the message (equal parts) a fraction of
    them changed: by +-1 (``ulp``), by up to +-130 (``small``: both sides of an int8 difference),
    by +-127 (``edge``: the largest that fit), to other bits (``far``), or across the word's sign
    (``wrap``: 0x7F.. <-> 0x80.., a wrapped difference that looks small)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(_FMT[word]).newbyteorder("<")
    old = rng.integers(0, 256, n * word, dtype=np.uint8)
    new = old.copy()
    ow, nw = old.view(dt), new.view(dt)
    bounds = np.linspace(0, n, len(segments) + 1).astype(int)
    info = np.iinfo(dt)
    for (frac, mode), s, e in zip(segments, bounds[:-1], bounds[1:], strict=True):
        pick = s + np.flatnonzero(rng.random(e - s) < frac)
        k = pick.size
        if mode == "ulp":
            nw[pick] = (ow[pick].astype(np.int64) + rng.choice([-1, 1], k)).astype(dt)   # wraps, as words do
        elif mode in ("small", "edge"):
            step = (rng.integers(1, 131, k) if mode == "small" else 127) * rng.choice([-1, 1], k)
            nw[pick] = np.clip(ow[pick].astype(np.int64) + step, info.min, info.max).astype(dt)
        elif mode == "far":
            nw[pick] = ow[pick] ^ rng.integers(1, 256, k).astype(dt)
        else:
            ow[pick] = info.max - rng.integers(0, 3, k).astype(dt)
            nw[pick] = info.min + rng.integers(0, 3, k).astype(dt)
    if not n:    # torch makes an empty numpy array a tensor of stride 0, which no view to words takes
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(new), torch.from_numpy(old)


@st.composite
def _cases(draw):
    word = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 3000))
    segments = draw(st.lists(st.tuples(st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.5, 0.95, 1.0]),
                                       st.sampled_from(_MODES)), min_size=1, max_size=4))
    kinds = [None, D.DENSE] + [k for k in D.KINDS if k != D.DENSE and (not k & D.DIFF8 or word in (2, 4))]
    return word, n, draw(st.integers(0, 2 ** 32 - 1)), segments, draw(st.sampled_from(kinds)), draw(st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases(), st.sampled_from([8, 64, 1 << 18]))
def test_encode_equals_the_plain_codec(case, chunk):
    """Random words, every width, changed fractions from none to all (mixed within a message),
    every kind asked for or chosen, with and without ``force_sparse``; scan chunks of ``chunk``
    bytes (8: a handful of words each)."""
    word, n, seed, segments, kind, force = case
    new, old = _message(word, n, seed, segments)
    with mock.patch.object(kernels.delta, "_CPU_CHUNK_BYTES", chunk):
        enc = _check(new, old, word, kind=kind, force_sparse=force)
        if kind is not None:
            _check(new, old, word, force_sparse=force)     # and the kind it would choose
    if enc.kind != D.DENSE:
        base = old.clone()
        D.decode(enc.kind, enc.payload, base, word, enc.entries)
        assert torch.equal(base, new)


@pytest.mark.parametrize("kind", [None, D.GAP16, D.GAP16 | D.DIFF8, D.GAP8, D.GAP8 | D.DIFF8])
def test_fillers_of_both_gap_widths(kind):
    """Runs of unchanged words longer than 65535 (GAP16 fillers) and than 255 (GAP8's), in a
    message of two scan chunks of the default size, and of many of 256 words."""
    n = 3 * 65536 + 77
    segments = [(0.0005, "ulp"), (0.0, "ulp"), (0.0, "ulp"), (0.003, "small"), (0.2, "far")]
    new, old = _message(2, n, 11, segments)            # the middle 40% unchanged: one GAP16 filler
    new.view(torch.int16)[:3] += 1                       # the first words: a gap from -1
    enc = _check(new, old, 2, kind=kind)
    assert enc.entries > enc.changed or kind is None
    with mock.patch.object(kernels.delta, "_CPU_CHUNK_BYTES", 512):
        _check(new, old, 2, kind=kind)


def test_dense_decided_early_equals_the_sizes():
    """Every word changed: DENSE from the escapes' lower bound (before compacting) when they are far,
    BITMASK | DIFF8 when they are one step or 127; wrapped differences (0x7FFF -> 0x8000 looks like
    +1 in 16 bits) are escapes either way."""
    for mode in ("far", "ulp", "edge", "wrap"):
        for word in (2, 4):
            new, old = _message(word, 5000, 3, [(1.0, mode)])
            _check(new, old, word)
            _check(new, old, word, force_sparse=True)
