"""The delta codec of cross-host refits: only the elements that changed since the receiver's base.

A cross-host message (:class:`~tritonreshard.planning.Message`) is a flat run of bytes. The sender
keeps a snapshot of what it last sent in that message; the receiving relay's buffer holds the same
bytes (its *base*). Both are viewed as integer words (:func:`word_dtype`: the width of the
message's elements), so the comparison is of bits: NaN payloads, ``-0.0`` and subnormals are
elements like any other, never "equal" by value.

A sparse payload is two sections: **where** the changed words are, then **what** they become.

Where (one of):

* ``BITMASK``: one bit per word (changed or not);
* ``INDEX32``: the changed words' int32 positions;
* ``GAP16`` / ``GAP8``: the distance from each changed word to the previous one as a uint16 /
  uint8. A distance over 65535 / 255 is bridged by filler entries on unchanged words (their value
  is the word as it is, their difference 0: applying them changes nothing).

What (one of):

* the new words themselves (``word`` bytes an entry);
* ``DIFF8`` (2- and 4-byte words): the difference of the new word from the base's, read as signed
  integers, in one int8; an entry whose difference does not fit (-127..127) carries -128 and its
  new word follows in an escape list. An Adam-sized step moves a bf16 weight that changes by one
  unit in the last place (its bits by +-1), so nearly every entry is one byte.

:func:`encode` picks, per message, the smallest of all of them and ``DENSE`` (the new bytes as they
are). At 2.5% changed bf16 ``GAP8 | DIFF8`` is 1 + 1 bytes per changed element: 2.5% of dense (plus
the escapes), against 3.75% for uint8 gaps with values, 5% for uint16 gaps, 7.5% for int32 indices
and 8.75% for a bitmask. An encoding is chosen only when it is smaller than dense (``force_sparse``
aside, for tests), so a message never carries more than its dense bytes.

Every section starts at a multiple of 8 bytes (so its views are aligned; the padding is zeros, so a
payload is defined to the byte). :func:`decode` writes into the base in place.

:func:`encode` compares and compacts with Triton on CUDA (``kernels.delta``: two passes over the
words, the bitmask and the block counts from the first) and with torch elsewhere, as its
:class:`~tritonreshard.kernels.CopyBackend` says; the two give the same bytes. On CPU the torch
backend's scan reads both messages once, a chunk at a time in cache, with numpy, and the sections are
made with numpy from counts (:func:`_encode_numpy`): the same bytes again, at >1 GB/s a core for an
Adam step (``bench/delta_detect.py``). :func:`decode` is torch on any device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import AutoBackend, CopyBackend, TorchDeltaScan, copy_backend

__all__ = ["DENSE", "BITMASK", "INDEX32", "GAP16", "GAP8", "DIFF8", "KINDS", "Encoded", "word_dtype", "word_size",
           "encode", "decode", "encoded_sizes"]

DENSE, BITMASK, INDEX32, GAP16, GAP8 = 0, 1, 2, 3, 4
DIFF8 = 8                             # a flag on a positions kind: the values as int8 differences
_WHERE = {BITMASK: "bitmask", INDEX32: "index32", GAP16: "gap16", GAP8: "gap8"}
KINDS = {DENSE: "dense", **_WHERE, **{k | DIFF8: f"{name}+diff8" for k, name in _WHERE.items()}}
_MAX_GAP = {GAP16: 65535, GAP8: 255}  # the largest distance one gap holds
_GAP_DTYPE = {GAP16: torch.int16, GAP8: torch.uint8}
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIFF_WORDS = (2, 4)                  # word widths DIFF8 is offered for (1: no gain; 8: int64 range)
_ESCAPE = -128                        # the DIFF8 byte of an entry whose new word follows whole
_SECTION = 8                          # payload sections start at multiples of this
_GAP_NP = {GAP16: np.uint16, GAP8: np.uint8}   # the gap sections as numpy writes them (same bits)


def _align(n: int) -> int:
    return -(-n // _SECTION) * _SECTION


def word_size(*sizes: int) -> int:
    """The widest integer word (1, 2, 4 or 8 bytes) dividing every one of ``sizes`` (a message's
    element sizes, byte count and offsets), so the bytes can be viewed as words of that width."""
    g = 8
    for s in sizes:
        g = math.gcd(g, int(s))
    return g if g in _WORDS else 1


def word_dtype(word: int) -> torch.dtype:
    """The integer dtype of a ``word``-byte word (compared by bits)."""
    if word not in _WORDS:
        raise ValueError(f"word_dtype: word must be 1, 2, 4 or 8 bytes, got {word!r}")
    return _WORDS[word]


@dataclass(frozen=True)
class Encoded:
    """One message's encoding for one refit.

    ``kind``: ``DENSE``, or a positions kind (``BITMASK`` / ``INDEX32`` / ``GAP16`` / ``GAP8``),
    optionally ``| DIFF8``; ``nbytes``: the bytes that travel (for ``DENSE`` the message's own
    bytes); ``words``: the message's length in words of ``word`` bytes; ``changed``: the words that
    differ from the snapshot; ``entries``: the entries of the sparse encoding (``changed``, plus the
    gap fillers of a gap kind; for ``DENSE`` 0); ``payload``: the flat uint8 bytes to send, or None
    for ``DENSE`` (the new bytes are sent as they are).
    """

    kind: int
    nbytes: int
    words: int
    word: int
    changed: int
    entries: int = 0
    payload: torch.Tensor | None = None


def _where_bytes(kind: int, words: int, entries: int) -> int:
    """Bytes of the positions section of ``kind`` (without ``DIFF8``) with ``entries`` entries."""
    if kind == BITMASK:
        return _align(-(-words // 8))
    return _align({INDEX32: 4, GAP16: 2, GAP8: 1}[kind] * entries)


def encoded_sizes(words: int, word: int, changed: int, *, gap16: int | None = None, gap8: int | None = None,
                  escapes: int | None = None) -> dict[int, int]:
    """Bytes of each encoding of a message of ``words`` words of ``word`` bytes with ``changed``
    changed words: ``{kind: bytes}``, ``DENSE`` included. ``gap16`` / ``gap8``: the entries of
    ``GAP16`` / ``GAP8`` (changed plus fillers; default ``changed``); ``escapes``: the changed words
    whose difference does not fit int8 (None: no ``DIFF8`` kinds; they exist for 2- and 4-byte
    words only)."""
    entries = {BITMASK: changed, GAP16: changed if gap16 is None else gap16, GAP8: changed if gap8 is None else gap8}
    if words < 2 ** 31:
        entries[INDEX32] = changed
    sizes = {DENSE: words * word}
    for k, m in entries.items():
        where = _where_bytes(k, words, m)
        sizes[k] = where + m * word
        if escapes is not None and word in _DIFF_WORDS:
            sizes[k | DIFF8] = where + _align(m) + escapes * word
    return sizes


def _gap_positions(idx: torch.Tensor, gaps: torch.Tensor, max_gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx`` (sorted int64 positions; ``gaps``: each one's distance from the previous, the first's
    from -1) with fillers so that no two consecutive positions are more than ``max_gap`` apart.
    Returns ``(pos, slots)``: the positions with the fillers, and where each of ``idx`` is in them.
    Only the gaps that need fillers are expanded (at a few % changed, a handful)."""
    fill = (gaps - 1) // max_gap
    cum = torch.cumsum(fill, 0)
    slots = torch.arange(idx.numel(), device=idx.device) + cum
    pos = torch.empty(idx.numel() + int(cum[-1]), dtype=idx.dtype, device=idx.device)
    pos[slots] = idx
    big = torch.nonzero(fill).view(-1)
    f = fill[big]
    prev = (idx - gaps)[big]                       # the previous changed position (or -1)
    owner = torch.repeat_interleave(torch.arange(big.numel(), device=idx.device), f)
    j = torch.arange(owner.numel(), device=idx.device) - (torch.cumsum(f, 0) - f)[owner]
    # entry i's fillers sit just before it: prev + max_gap, prev + 2 * max_gap, ...
    pos[(slots[big] - f)[owner] + j] = prev[owner] + max_gap * (j + 1)
    return pos, slots


def _gaps(pos: torch.Tensor) -> torch.Tensor:
    """Each of ``pos`` (sorted int64 positions) minus the one before it, the first minus -1."""
    return torch.diff(pos, prepend=pos.new_full((1,), -1))


def _diffs(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new - old`` (words, read as signed integers) exactly: int32 for 2-byte words (half the
    memory traffic of int64), int64 otherwise."""
    wide = torch.int32 if new.element_size() <= 2 else torch.int64
    return new.to(wide) - old.to(wide)


def _check_encode(new: torch.Tensor, old: torch.Tensor, word: int, backend, kind: int | None) -> CopyBackend:
    """encode's arguments: one ValueError naming every problem; the backend they name."""
    problems: list[str] = []
    if new.dtype != torch.uint8 or old.dtype != torch.uint8 or new.shape != old.shape or new.dim() != 1:
        problems.append(f"new and old must be flat uint8 tensors of one length, got "
                        f"{new.dtype} {tuple(new.shape)} and {old.dtype} {tuple(old.shape)}")
    elif new.numel() % word:
        problems.append(f"{new.numel()} bytes is not a multiple of word={word}")
    chosen = AutoBackend() if backend is None else copy_backend(backend, problems)
    if kind is not None and (kind not in KINDS or (kind & DIFF8 and word not in _DIFF_WORDS)
                             or (kind & ~DIFF8 == INDEX32 and new.numel() // word >= 2 ** 31)):
        problems.append(f"kind={kind!r} is not one of {sorted(KINDS)} for word={word} "
                        f"(DIFF8: words of {_DIFF_WORDS} bytes; INDEX32: under 2**31 words)")
    if problems:
        raise ValueError("encode: " + "; ".join(problems))
    return chosen


def _dense_before_compacting(nw: torch.Tensor, ow: torch.Tensor, word: int, changed: int, nmask: int,
                             kind: int | None, force_sparse: bool, far: int | None = None) -> bool:
    """Whether ``DENSE`` is the answer before the positions are compacted: asked for, or no sparse
    encoding can beat it. Every sparse encoding costs at least one byte an entry or one bit a word
    for its positions, plus its values: the words themselves, or (DIFF8) one byte each and the
    escaped words whole. The escapes are counted (a pass over every word) only where DIFF8 alone
    could still win: at most 1/16 unchanged. ``far``: a lower bound of them instead (a CPU scan's
    ``far_at_least``, counted in the same pass as the compare): a False then only means that the
    sizes decide, as they would."""
    if kind == DENSE:
        return True
    dense = nw.numel() * word
    if kind is not None or force_sparse or min(changed * (word + 1), nmask + changed * word) < dense:
        return False
    diff8_bound = min(2 * changed, nmask + changed)
    if word not in _DIFF_WORDS or diff8_bound >= dense:
        return True
    if far is not None:
        return diff8_bound + far * word >= dense
    escaped = int(torch.count_nonzero(_diffs(nw, ow).abs() > 127))
    return diff8_bound + escaped * word >= dense


def _pick(sizes: dict[int, int], kind: int | None, force_sparse: bool) -> int:
    """The kind to send: ``kind`` if asked for, else the smallest (ties to the lower kind, so
    ``DENSE`` first), leaving out ``DENSE`` when ``force_sparse``."""
    if kind is not None:
        return kind
    candidates = {k: s for k, s in sizes.items() if k != DENSE} if force_sparse else sizes
    return min(candidates, key=lambda k: (candidates[k], k))


def _encode_numpy(scan: TorchDeltaScan, n: int, word: int, kind: int | None, force_sparse: bool) -> Encoded:
    """:func:`encode` after a CPU scan, with numpy: the bytes of the torch code there, from the
    positions and both words of the changed ones (``scan.compact_numpy()``, gathered while in
    cache). Every size comes from counts (the gaps over 255, the differences over 127); fillers are
    made only where a gap needs them (at a few % changed, a handful) and only for the kind sent;
    what is made per changed word is as narrow as it can be (int32 positions and gaps under 2**31
    words, the int8 differences in the payload itself), as these passes are bound by memory."""
    if kind is None and scan.changed and _align(scan.changed) >= scan.nmask:
        return _encode_bitmask_numpy(scan, n, word, force_sparse)
    idx, vals, olds = scan.compact_numpy()
    changed = idx.size
    gaps = np.empty(changed, dtype=idx.dtype)      # as _gaps: each position minus the one before, the first minus -1
    if changed:
        gaps[0] = idx[0] + 1
        np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    big = np.flatnonzero(gaps > _MAX_GAP[GAP8])     # the only gaps that need fillers, of either kind
    fill = {k: (gaps[big] - 1) // mg for k, mg in _MAX_GAP.items()}
    shifted = esc = None
    if word in _DIFF_WORDS:
        # the exact difference (as _diffs) plus 127: -127..127 -> 0..254, every other one beyond
        # 254 when read unsigned (the negative ones too)
        wide = np.dtype(np.int32 if word == 2 else np.int64)
        shifted = np.subtract(vals, olds, dtype=wide)
        shifted += 127
        esc = np.flatnonzero(shifted.view(f"u{wide.itemsize}") > 254)
    sizes = encoded_sizes(n, word, changed, gap16=changed + int(fill[GAP16].sum()),
                          gap8=changed + int(fill[GAP8].sum()), escapes=None if esc is None else esc.size)
    kind = _pick(sizes, kind, force_sparse)
    if kind == DENSE:
        return Encoded(DENSE, sizes[DENSE], n, word, changed)
    where = kind & ~DIFF8
    payload = torch.zeros(sizes[kind], dtype=torch.uint8)     # zeros: the padding
    p = payload.numpy()
    before = None           # gap kinds with fillers: the entries they go before (one each)
    if where in _MAX_GAP and int(fill[where].sum()):
        mg, has = _MAX_GAP[where], fill[where] > 0
        at, f = big[has], fill[where][has]
        before = np.repeat(at, f)
    m = changed + (0 if before is None else before.size)
    wbytes = _where_bytes(where, n, m)
    if where == BITMASK:
        scan.write_bitmask(payload)
    elif where == INDEX32:
        np.copyto(p[:4 * m].view(np.int32), idx, casting="unsafe")
    else:
        gd = np.dtype(_GAP_NP[where])
        section = p[:m * gd.itemsize].view(gd)
        if before is None:  # 1..65535 as uint16 bits (the int16 of the torch code), 1..255 as uint8
            np.copyto(section, gaps, casting="unsafe")
        else:
            g = gaps.astype(gd)     # the gaps over mg wrap here, and are set next:
            g[at] = gaps[at] - f * mg   # a filler's gap is mg, the entry after it keeps the rest
            section[:] = np.insert(g, before, mg)
    if kind & DIFF8:
        d8 = shifted.astype(np.int8)
        d8 -= 127               # wraps back to the difference where it fits (-127..127)
        d8[esc] = _ESCAPE
        if before is not None:  # a filler's difference: 0
            d8 = np.insert(d8, before, 0)
        p[wbytes:wbytes + m].view(np.int8)[:] = d8
        p[wbytes + _align(m):].view(vals.dtype)[:] = vals[esc]
    else:
        values = vals
        if before is not None:  # a filler's value: its word as it is, at prev + mg, prev + 2 mg, ...
            j = np.arange(before.size) - np.repeat(np.cumsum(f) - f, f) + 1
            prev = idx[at].astype(np.int64) - gaps[at]
            values = np.insert(vals, before, scan.nw.numpy()[np.repeat(prev, f) + mg * j])
        p[wbytes:].view(vals.dtype)[:] = values
    return Encoded(kind, sizes[kind], n, word, changed, m, payload)


def _encode_bitmask_numpy(scan: TorchDeltaScan, n: int, word: int, force_sparse: bool) -> Encoded:
    """:func:`_encode_numpy` where at least one word in 8 changed (the bitmask's bytes at most the
    changed words'): every positions section is then at least as long as the bitmask and holds at
    least as many entries, and ties go to the lower kind, so the answer is ``DENSE``, ``BITMASK`` or
    ``BITMASK | DIFF8``, and neither positions nor gaps are needed. A chunk at a time, the changed
    words are taken by the chunk's mask and their differences made (the escapes counted exactly);
    where nearly all changed, every word's difference is made and the changed ones taken after, as
    numpy's boolean take is fast only where it takes nearly all."""
    a, b = scan.nw.numpy(), scan.ow.numpy()
    changed = scan.changed
    wide = np.dtype(np.int32 if word == 2 else np.int64)

    def nearly_all(m: np.ndarray) -> bool:
        return 16 * int(np.count_nonzero(m)) >= 15 * m.size

    def changed_words(s: int, e: int, m: np.ndarray) -> np.ndarray:
        return a[s:e][m] if nearly_all(m) else a[s:e].take(np.flatnonzero(m))

    def diffs(s: int, e: int, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        every = nearly_all(m)
        j = None if every else np.flatnonzero(m)
        new, old = (a[s:e], b[s:e]) if every else (a[s:e].take(j), b[s:e].take(j))
        shifted = np.subtract(new, old, dtype=wide)   # as _encode_numpy
        shifted += 127
        far = shifted.view(f"u{wide.itemsize}") > 254
        d8 = shifted.astype(np.int8)
        d8 -= 127
        d8[far] = _ESCAPE
        return (d8[m] if every else d8), new[far]

    parts = escapes = None
    if word in _DIFF_WORDS:
        parts = scan.map_chunks(diffs)
        escapes = sum(x.size for _, x in parts)
    sizes = {k: s for k, s in encoded_sizes(n, word, changed, escapes=escapes).items()
             if k in (DENSE, BITMASK, BITMASK | DIFF8)}
    kind = _pick(sizes, None, force_sparse)
    if kind == DENSE:
        return Encoded(DENSE, sizes[DENSE], n, word, changed)
    payload = torch.zeros(sizes[kind], dtype=torch.uint8)     # zeros: the padding
    p = payload.numpy()
    scan.write_bitmask(payload)
    wbytes = scan.nmask
    if kind == BITMASK:
        p[wbytes:].view(a.dtype)[:] = np.concatenate(scan.map_chunks(changed_words))
    else:
        p[wbytes:wbytes + changed].view(np.int8)[:] = np.concatenate([d for d, _ in parts])
        p[wbytes + _align(changed):].view(a.dtype)[:] = np.concatenate([x for _, x in parts])
    return Encoded(kind, sizes[kind], n, word, changed, changed, payload)


def _write_where(payload: torch.Tensor, where: int, delta, idx: torch.Tensor, gaps: torch.Tensor,
                 pos: torch.Tensor, slots: torch.Tensor | None) -> None:
    """The positions section of kind ``where`` (``pos``: the positions with gap fillers, ``slots``
    None when there are none) at the start of ``payload``."""
    m = pos.numel()
    if where == BITMASK:
        delta.write_bitmask(payload)
    elif where == INDEX32:
        payload[:4 * m].view(torch.int32).copy_(idx)
    else:
        gd = _GAP_DTYPE[where]
        g = gaps if slots is None else _gaps(pos)
        # 1..65535 as uint16 bits (two's complement of the int32), 1..255 as uint8
        payload[:m * gd.itemsize].view(gd).copy_(g.to(torch.int32).to(gd))


def encode(new: torch.Tensor, old: torch.Tensor, word: int, *, force_sparse: bool = False,
           backend=None, kind: int | None = None) -> Encoded:
    """Encode ``new`` against ``old`` (flat uint8 tensors of the same length, on one device,
    a multiple of ``word`` bytes). Returns the smallest :class:`Encoded` (``DENSE`` when no sparse
    encoding is smaller; ``force_sparse``: the smallest sparse one even if it is not; ``kind``:
    that one of :data:`KINDS`, whatever its size, for tests and benches).

    ``backend``: a :class:`~tritonreshard.kernels.CopyBackend` or its name: ``"triton"`` (the
    compare-and-compact kernels of ``kernels.delta``: two passes over the words, interpreted on
    CPU), ``"torch"``, or ``"auto"`` / None: Triton on CUDA, torch elsewhere. Both give the same
    encoding, byte for byte; messages of 2**31 words or more use torch."""
    backend = _check_encode(new, old, word, backend, kind)
    wd = word_dtype(word)
    nw, ow = new.view(wd), old.view(wd)
    n = nw.numel()
    nmask = _align(-(-n // 8))
    delta = backend.delta_scan(nw, ow, nmask)
    changed = delta.changed
    cpu = isinstance(delta, TorchDeltaScan) and delta.cpu
    if _dense_before_compacting(nw, ow, word, changed, nmask, kind, force_sparse, delta.far_at_least if cpu else None):
        return Encoded(DENSE, n * word, n, word, changed)
    if cpu:
        return _encode_numpy(delta, n, word, kind, force_sparse)
    idx, vals = delta.compact()
    gaps = _gaps(idx)
    fillers = {k: int(((gaps - 1) // m).sum()) for k, m in _MAX_GAP.items()}
    escapes = d = None
    if word in _DIFF_WORDS:
        d = _diffs(vals, ow[idx])
        escapes = int(torch.count_nonzero(d.abs() > 127))
    sizes = encoded_sizes(n, word, changed, gap16=changed + fillers[GAP16], gap8=changed + fillers[GAP8],
                          escapes=escapes)
    kind = _pick(sizes, kind, force_sparse)
    if kind == DENSE:
        return Encoded(DENSE, sizes[DENSE], n, word, changed)
    where = kind & ~DIFF8
    payload = torch.zeros(sizes[kind], dtype=torch.uint8, device=new.device)  # zeros: the padding
    pos, slots = (_gap_positions(idx, gaps, _MAX_GAP[where]) if where in _MAX_GAP and fillers[where]
                  else (idx, None))
    m = pos.numel()
    wbytes = _where_bytes(where, n, m)
    _write_where(payload, where, delta, idx, gaps, pos, slots)
    values = nw[pos] if slots is not None else vals        # a filler's value: its word as it is
    if not kind & DIFF8:
        payload[wbytes:].view(wd).copy_(values)
        return Encoded(kind, sizes[kind], n, word, changed, m, payload)
    if slots is not None:                                   # a filler's difference: 0
        d = torch.zeros(m, dtype=d.dtype, device=d.device).index_copy_(0, slots, d)
    esc = d.abs() > 127
    payload[wbytes:wbytes + m].view(torch.int8).copy_(torch.where(esc, _ESCAPE, d))
    payload[wbytes + _align(m):].view(wd).copy_(values[esc])
    return Encoded(kind, sizes[kind], n, word, changed, m, payload)


def decode(kind: int, payload: torch.Tensor, base: torch.Tensor, word: int, entries: int) -> None:
    """Apply a sparse encoding (``payload``, flat uint8, ``entries`` entries) to ``base`` (flat
    uint8, the bytes the encoding was made against) in place. ``DENSE`` is not decoded: its bytes
    are the message itself. A payload that does not fit the base (positions past its end, a length
    other than its kind's) is a ValueError, before the base changes."""
    if kind not in KINDS or kind == DENSE or (kind & DIFF8 and word not in _DIFF_WORDS):
        raise ValueError(f"decode: kind must be a sparse kind ({sorted(k for k in KINDS if k != DENSE)}; "
                         f"DIFF8 for words of {_DIFF_WORDS} bytes), got {kind!r} for word={word}")
    where = kind & ~DIFF8
    wd = word_dtype(word)
    bw = base.view(wd)
    n = bw.numel()
    wbytes = _where_bytes(where, n, entries)
    if where == BITMASK:
        if base.device.type == "cpu":   # numpy's unpackbits: ~15x the torch shifts below on CPU
            bits = torch.from_numpy(np.unpackbits(payload[:wbytes].numpy(), count=n, bitorder="little").view(np.bool_))
        else:
            shifts = torch.arange(8, dtype=torch.uint8, device=base.device)
            bits = ((payload[:wbytes].view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()
        idx = None
    elif where == INDEX32:
        idx = payload[:4 * entries].view(torch.int32).to(torch.int64)
    else:
        gd = _GAP_DTYPE[where]
        mask = (1 << (8 * gd.itemsize)) - 1
        idx = torch.cumsum(payload[:entries * gd.itemsize].view(gd).to(torch.int64) & mask, 0) - 1
    problems = []
    if idx is not None and entries and (int(idx[-1]) >= n or int(idx.min()) < 0):
        problems.append(f"positions up to {int(idx[-1])} for a base of {n} words")
    if idx is None and int(bits.sum()) != entries:
        problems.append(f"a bitmask of {int(bits.sum())} words for {entries} entries")
    d = payload[wbytes:wbytes + entries].view(torch.int8) if kind & DIFF8 else None
    escapes = int(torch.count_nonzero(d == _ESCAPE)) if d is not None else 0
    want = wbytes + (_align(entries) + escapes * word if d is not None else entries * word)
    if payload.numel() != want:
        problems.append(f"{payload.numel()} payload bytes where {KINDS[kind]} with {entries} entries "
                        f"({escapes} escapes) has {want}")
    if problems:
        raise ValueError("decode: " + "; ".join(problems))
    if not entries:
        return
    if d is None:
        vals = payload[wbytes:].view(wd)
        if idx is None:
            bw.masked_scatter_(bits, vals)
        else:
            bw[idx] = vals
        return
    if idx is None:
        idx = torch.nonzero(bits).view(-1)
    esc = d == _ESCAPE
    # escaped entries' differences are not differences: add 0 there, then put their words whole
    new = (bw[idx].to(torch.int64) + torch.where(esc, 0, d.to(torch.int64))).to(wd)  # in range: exact
    new[esc] = payload[wbytes + _align(entries):].view(wd)
    bw[idx] = new
