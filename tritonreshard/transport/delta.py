"""The delta codec of cross-host refits: only the elements that changed since the receiver's base.

A cross-host message (:class:`~tritonreshard.planning.Message`) is a flat run of bytes. The sender
keeps a snapshot of what it last sent in that message; the receiving relay's buffer holds the same
bytes (its *base*). Both are viewed as integer words (:func:`word_dtype`: the width of the
message's elements), so the comparison is of bits: NaN payloads, ``-0.0`` and subnormals are
elements like any other, never "equal" by value.

:func:`encode` compares the new bytes with the snapshot and picks, per message, the cheapest of:

* ``DENSE``: the new bytes themselves (nothing extra; chosen when no delta is cheaper);
* ``BITMASK``: one bit per word (changed or not), then the changed words' new values;
* ``INDEX32``: the changed words' int32 positions, then their values (kept for reference: it never
  beats ``GAP16`` by more than the gap fillers below, and is chosen only then);
* ``GAP16``: the distance from each changed word to the previous one as a uint16, then the
  values. A distance over 65535 is bridged by filler entries that carry the new value of an
  unchanged word (so applying them changes nothing): at 2.5% changed bf16 this is 2 + 2 bytes
  per changed element, 5% of dense, against 7.5% for int32 indices and 8.75% for a bitmask.

Every section of a payload starts at a multiple of 8 bytes (so its views are aligned; the padding
is zeros, so a payload is defined to the byte). An encoding is chosen only when it is smaller than
dense (``force_sparse`` aside, for tests), so a message never carries more than its dense bytes.
:func:`decode` writes the values into the base in place.

:func:`encode` compares and compacts with Triton on CUDA (``kernels.delta``: two passes over the
words, the bitmask and the block counts from the first) and with torch elsewhere; the two give the
same bytes. :func:`decode` is torch on any device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.delta import delta_compact, delta_count

__all__ = ["DENSE", "BITMASK", "INDEX32", "GAP16", "KINDS", "Encoded", "word_dtype", "word_size", "encode",
           "decode", "encoded_sizes"]

DENSE, BITMASK, INDEX32, GAP16 = 0, 1, 2, 3
KINDS = {DENSE: "dense", BITMASK: "bitmask", INDEX32: "index32", GAP16: "gap16"}
_MAX_GAP = 65535                      # the largest distance one uint16 gap holds
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SECTION = 8                          # payload sections start at multiples of this
_GATHER_BITS = 0x0102040810204080     # see encode (BITMASK)


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

    ``kind``: ``DENSE`` / ``BITMASK`` / ``INDEX32`` / ``GAP16``; ``nbytes``: the bytes that travel
    (for ``DENSE`` the message's own bytes); ``words``: the message's length in words of ``word``
    bytes; ``changed``: the words that differ from the snapshot; ``entries``: the entries of the
    sparse encoding (``changed``, plus the gap fillers for ``GAP16`` and ``DENSE``, which was
    weighed against it); ``payload``: the flat uint8 bytes to send, or
    None for ``DENSE`` (the new bytes are sent as they are).
    """

    kind: int
    nbytes: int
    words: int
    word: int
    changed: int
    entries: int = 0
    payload: torch.Tensor | None = None


def encoded_sizes(words: int, word: int, changed: int, entries: int) -> dict[int, int]:
    """Bytes of each encoding of a message of ``words`` words of ``word`` bytes with ``changed``
    changed words, ``entries`` of them in ``GAP16`` (changed plus fillers)."""
    sizes = {DENSE: words * word,
             BITMASK: _align(-(-words // 8)) + changed * word,
             GAP16: _align(2 * entries) + entries * word}
    if words < 2 ** 31:
        sizes[INDEX32] = _align(4 * changed) + changed * word
    return sizes


def _gap_positions(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` (sorted int64 positions) with fillers so that no two consecutive positions (and the
    first from -1) are more than ``_MAX_GAP`` apart."""
    prev = torch.cat([idx.new_full((1,), -1), idx[:-1]])
    fill = (idx - prev - 1) // _MAX_GAP
    if not bool(fill.any()):
        return idx
    counts = fill + 1
    rep_prev = torch.repeat_interleave(prev, counts)
    rep_idx = torch.repeat_interleave(idx, counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    j = torch.arange(rep_idx.numel(), device=idx.device) - starts + 1
    return torch.minimum(rep_prev + _MAX_GAP * j, rep_idx)


def encode(new: torch.Tensor, old: torch.Tensor, word: int, *, force_sparse: bool = False,
           backend: str | None = None) -> Encoded:
    """Encode ``new`` against ``old`` (flat uint8 tensors of the same length, on one device,
    a multiple of ``word`` bytes). Returns the cheapest :class:`Encoded` (``DENSE`` when no sparse
    encoding is smaller; ``force_sparse``: the cheapest sparse one even if it is not).

    ``backend``: ``"triton"`` (the compare-and-compact kernels of ``kernels.delta``: two passes
    over the words, interpreted on CPU), ``"torch"``, or None: Triton on CUDA, torch elsewhere.
    Both give the same encoding, byte for byte; messages of 2**31 words or more use torch."""
    problems = []
    if new.dtype != torch.uint8 or old.dtype != torch.uint8 or new.shape != old.shape or new.dim() != 1:
        problems.append(f"new and old must be flat uint8 tensors of one length, got "
                        f"{new.dtype} {tuple(new.shape)} and {old.dtype} {tuple(old.shape)}")
    elif new.numel() % word:
        problems.append(f"{new.numel()} bytes is not a multiple of word={word}")
    if backend not in (None, "torch", "triton"):
        problems.append(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    if problems:
        raise ValueError("encode: " + "; ".join(problems))
    wd = word_dtype(word)
    nw, ow = new.view(wd), old.view(wd)
    n = nw.numel()
    nmask = _align(-(-n // 8))
    if backend is None:
        backend = "triton" if new.device.type == "cuda" else "torch"
    fused = backend == "triton" and n < 2 ** 31
    if fused:
        # pass 1: per-block counts and the bitmask (its bytes are the BITMASK section as they are)
        counts, bits = delta_count(nw, ow, nmask)
        changed = int(counts.sum())
    else:
        mask = nw != ow
        changed = int(torch.count_nonzero(mask))
    # Every sparse encoding costs at least its values plus 2 bytes an entry or 1 bit a word: when
    # none of those bounds beats dense, the positions are never compacted.
    if not force_sparse and min(changed * (word + 2), nmask + changed * word) >= n * word:
        return Encoded(DENSE, n * word, n, word, changed, changed)
    if fused:
        # pass 2: the changed words' positions (ascending, as nonzero gives them) and new values
        idx32, vals = delta_compact(nw, ow, counts, changed)
        idx = idx32.to(torch.int64)
    else:
        idx = torch.nonzero(mask).view(-1)
        vals = None
    # Entries of GAP16: the changed words plus one filler per 65535 words of an unchanged run.
    pos = _gap_positions(idx) if changed else idx
    sizes = encoded_sizes(n, word, changed, pos.numel())
    candidates = {k: s for k, s in sizes.items() if k != DENSE} if force_sparse else sizes
    kind = min(candidates, key=lambda k: (candidates[k], k))
    if kind == DENSE:
        return Encoded(DENSE, sizes[DENSE], n, word, changed, pos.numel())
    payload = torch.empty(sizes[kind], dtype=torch.uint8, device=new.device)
    values = payload[{BITMASK: nmask, INDEX32: _align(4 * changed), GAP16: _align(2 * pos.numel())}[kind]:]
    if kind != GAP16 or pos.numel() == changed:
        values.view(wd).copy_(nw[idx] if vals is None else vals)
    else:
        values.view(wd).copy_(nw[pos])
    if kind == BITMASK:
        if fused:
            payload[:nmask] = bits
        else:
            padded = torch.zeros(nmask * 8, dtype=torch.uint8, device=new.device)
            padded[:n] = mask
            # Eight 0/1 bytes (an int64, little-endian) -> one byte, first byte lowest bit: the
            # product gathers byte i into bit 56 + i, with no carries between them.
            payload[:nmask] = ((padded.view(torch.int64) * _GATHER_BITS) >> 56).to(torch.uint8)
        return Encoded(BITMASK, sizes[kind], n, word, changed, changed, payload)
    if kind == INDEX32:
        payload[:4 * changed].view(torch.int32).copy_(idx)
        payload[4 * changed:_align(4 * changed)].zero_()  # padding: the bytes sent are all defined
        return Encoded(INDEX32, sizes[kind], n, word, changed, changed, payload)
    m = pos.numel()
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1))
    payload[:2 * m].view(torch.int16).copy_(gaps.to(torch.int32).to(torch.int16))  # 1..65535 as uint16 bits
    payload[2 * m:_align(2 * m)].zero_()
    return Encoded(GAP16, sizes[kind], n, word, changed, m, payload)


def decode(kind: int, payload: torch.Tensor, base: torch.Tensor, word: int, entries: int) -> None:
    """Apply a sparse encoding (``payload``, flat uint8, ``entries`` entries) to ``base`` (flat
    uint8, the bytes the encoding was made against) in place. ``DENSE`` is not decoded: its bytes
    are the message itself."""
    wd = word_dtype(word)
    bw = base.view(wd)
    n = bw.numel()
    if kind == BITMASK:
        nmask = _align(-(-n // 8))
        shifts = torch.arange(8, dtype=torch.uint8, device=base.device)
        bits = ((payload[:nmask].view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()
        if entries:
            bw.masked_scatter_(bits, payload[nmask:nmask + entries * word].view(wd))
        return
    if kind == INDEX32:
        nidx = _align(4 * entries)
        idx = payload[:4 * entries].view(torch.int32).to(torch.int64)
    elif kind == GAP16:
        nidx = _align(2 * entries)
        idx = torch.cumsum(payload[:2 * entries].view(torch.int16).to(torch.int64) & 0xFFFF, 0) - 1
    else:
        raise ValueError(f"decode: kind must be BITMASK, INDEX32 or GAP16, got {kind!r}")
    if entries:
        if int(idx[-1]) >= n or int(idx[0]) < 0:
            raise ValueError(f"decode: positions up to {int(idx[-1])} for a base of {n} words")
        bw[idx] = payload[nidx:nidx + entries * word].view(wd)
