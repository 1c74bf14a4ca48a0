"""Compare and compact for the delta codec (:mod:`tritonreshard.transport.delta`): which words of a
message changed since the sender's snapshot, in two passes over the words.

* :func:`delta_count_kernel` (pass 1): one program per ``BLOCK`` words compares the new words with
  the snapshot's as integers (bits: NaN payloads and ``-0.0`` are words like any other), stores the
  block's number of changed words and its part of the codec's bitmask (bit ``i % 8`` of byte
  ``i // 8`` for word ``i``, the first word in the lowest bit).
* :func:`delta_compact_kernel` (pass 2): after an exclusive scan of the block counts (torch's
  ``cumsum``; a few thousand int64 per GiB), each block writes its changed words' int32 positions and
  new values at its offset, in ascending order (a scan inside the block gives each changed word its
  rank), so the output equals torch's ``nonzero`` and ``new[idx]`` exactly.

:class:`TritonDeltaScan` runs both passes for one message; :class:`TorchDeltaScan` is the same with
torch ops (any device, any length; on CPU with numpy, in one pass over chunks of the words), byte for
byte. A :class:`~tritonreshard.kernels.CopyBackend` says which one a message gets (``delta_scan``).

The snapshot is not updated here: the codec's contract is that it becomes the new version only
once the sends completed (``commit_sends``), so a failed send leaves the base the receiver holds.

Compiled on CUDA tensors, interpreted on CPU tensors (``_jit``): the interpreter is exact but slow
(tests only); speed is measured by ``bench/gpu_kernels.py`` on a GPU.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import triton.language as tl

from ._jit import interpreted, jit

__all__ = ["DELTA_BLOCK", "DELTA_WORDS", "DeltaLaunch", "TorchDeltaScan", "TritonDeltaScan", "delta_compact",
           "delta_compact_kernel", "delta_count", "delta_count_kernel", "delta_launch_configs"]

#: Words per program. 4096 words is 8 KiB of each input at bf16 (16 KiB at fp32): enough per
#: program to hide latency, small enough that the in-block scan stays in registers.
DELTA_BLOCK = 4096
#: The word dtypes the codec compares (its ``word_dtype`` of 1, 2, 4 and 8 bytes).
DELTA_WORDS = (torch.uint8, torch.int16, torch.int32, torch.int64)
# 8 warps: 16 words a thread. int64 words at 8 warps need 141 registers in the compact pass (the
# compile gate's limit is 128), so they get 16 warps (8 words a thread).
_NUM_WARPS = {1: 8, 2: 8, 4: 8, 8: 16}
_MAX_WORDS = 2 ** 31 - 1  # positions are int32
_GATHER_BITS = 0x0102040810204080     # see TorchDeltaScan.write_bitmask
#: Bytes of each message per chunk of TorchDeltaScan's CPU pass: a chunk of the message and of the
#: snapshot (2 x 256 KiB) and its mask stay in a core's L2 while they are compared and compacted.
_CPU_CHUNK_BYTES = 1 << 18
#: A chunk of which more than 1/_EAGER changed is compacted only if asked (``compact_numpy``): a
#: message of such is headed for DENSE or BITMASK, which need no positions, and compacting them costs
#: the most; up to 1/8, ``_flatnonzero``'s two steps are the fast ones.
_EAGER = 8
_UNSIGNED = {2: np.uint16, 4: np.uint32}   # the words the codec offers DIFF8 for, their bits unsigned


@jit
def _add(a, b):
    # tl.sum / tl.cumsum are @jit helpers the interpreted twin cannot call (``_jit``); a combine
    # function of this module's own is replaced by its twin, so reduce and scan with this one.
    return a + b


@jit
def _compare(new_ptr, old_ptr, n, BLOCK: tl.constexpr):
    """This program's block: ``(offs, a, changed)``: int64 word offsets, the new words, and where
    they differ from the snapshot's (as integers: bits; False past ``n``). Inlined by the compiler,
    so both passes keep the registers of one."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < n
    a = tl.load(new_ptr + offs, mask=inb, other=0)
    b = tl.load(old_ptr + offs, mask=inb, other=0)
    return offs, a, (a != b) & inb


@jit
def delta_count_kernel(
    new_ptr,  # [n] words (uint8 / int16 / int32 / int64): the message now
    old_ptr,  # [n] words of the same dtype: the snapshot
    counts_ptr,  # int32 [cdiv(n, BLOCK)]: changed words per block (out)
    bits_ptr,  # uint8 [>= cdiv(n, 8)]: the bitmask (out; bytes past the last block untouched)
    n,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs, a, changed = _compare(new_ptr, old_ptr, n, BLOCK)
    c = changed.to(tl.int32)
    tl.store(counts_ptr + pid, tl.reduce(c, 0, _add))
    # Eight flags -> one byte, word 8j + i in bit i of byte j (no carries: each shift is distinct).
    byte = tl.reduce(tl.reshape(c, [BLOCK // 8, 8]) << tl.arange(0, 8)[None, :], 1, _add)
    boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8).to(tl.int64)
    tl.store(bits_ptr + boffs, byte.to(tl.uint8), mask=boffs * 8 < n)


@jit
def delta_compact_kernel(
    new_ptr,  # [n] words: the message now
    old_ptr,  # [n] words: the snapshot
    starts_ptr,  # int64 [cdiv(n, BLOCK)]: exclusive scan of pass 1's counts
    idx_ptr,  # int32 [changed]: positions of the changed words, ascending (out)
    val_ptr,  # [changed] words: their new values (out)
    n,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs, a, changed = _compare(new_ptr, old_ptr, n, BLOCK)
    start = tl.load(starts_ptr + pid)
    dst = start + (tl.associative_scan(changed.to(tl.int32), 0, _add) - 1).to(tl.int64)
    tl.store(idx_ptr + dst, offs.to(tl.int32), mask=changed)
    tl.store(val_ptr + dst, a, mask=changed)


@dataclass(frozen=True)
class DeltaLaunch:
    """One launch of a delta kernel: ``kernel[grid](*args, **kwargs)``. :meth:`call` is the one
    place that makes the arguments (used by :meth:`launch` and by the compile gate)."""

    kernel: object
    args: tuple
    n: int

    def call(self):
        """``(kernel, grid, args, kwargs)``."""
        return (self.kernel, (-(-self.n // DELTA_BLOCK),), self.args,
                {"BLOCK": DELTA_BLOCK, "num_warps": _NUM_WARPS[self.args[0].element_size()]})

    def launch(self) -> None:
        """Enqueue (CUDA: the current stream of the tensors' device) or run now (CPU: interpreted)."""
        if self.n == 0:
            return
        kernel, grid, args, kw = self.call()
        device = args[0].device
        if device.type == "cpu":
            interpreted(kernel)[grid](*args, **kw)
        else:
            with torch.cuda.device(device):
                kernel[grid](*args, **kw)


def _check(new: torch.Tensor, old: torch.Tensor, who: str) -> None:
    problems = []
    if new.dtype not in DELTA_WORDS:
        problems.append(f"new has dtype {new.dtype}, not one of {[str(d) for d in DELTA_WORDS]}")
    if old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        problems.append(f"old is {old.dtype} {tuple(old.shape)} on {old.device}, new is {new.dtype} "
                        f"{tuple(new.shape)} on {new.device}")
    if new.dim() != 1 or not new.is_contiguous() or not old.is_contiguous():
        problems.append("new and old must be flat contiguous tensors")
    if new.numel() > _MAX_WORDS:
        problems.append(f"{new.numel()} words do not fit int32 positions")
    if new.device.type not in ("cpu", "cuda"):
        problems.append(f"device must be cpu or cuda, got {new.device}")
    if problems:
        raise ValueError(f"{who}: " + "; ".join(problems))


def _count_launch(new, old, counts, bits) -> DeltaLaunch:
    return DeltaLaunch(delta_count_kernel, (new, old, counts, bits, new.numel()), new.numel())


def _compact_launch(new, old, starts, idx, vals) -> DeltaLaunch:
    return DeltaLaunch(delta_compact_kernel, (new, old, starts, idx, vals, new.numel()), new.numel())


def delta_count(new: torch.Tensor, old: torch.Tensor, bits_bytes: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 over ``new`` and ``old`` (flat contiguous words of one dtype in :data:`DELTA_WORDS`,
    ``n`` < 2**31 of them, one device). Returns ``(counts, bits)``: ``counts`` int32
    ``[cdiv(n, DELTA_BLOCK)]`` changed words per block; ``bits`` uint8 ``[bits_bytes]`` (default
    ``cdiv(n, 8)``, at least that) the bitmask, zero past word ``n``. Enqueued on CUDA (no sync)."""
    _check(new, old, "delta_count")
    n = new.numel()
    nbits = -(-n // 8) if bits_bytes is None else int(bits_bytes)
    if nbits < -(-n // 8):
        raise ValueError(f"delta_count: bits_bytes={bits_bytes} < {-(-n // 8)} for {n} words")
    counts = torch.empty(-(-n // DELTA_BLOCK), dtype=torch.int32, device=new.device)
    bits = torch.empty(nbits, dtype=torch.uint8, device=new.device)
    bits[-(-n // 8):].zero_()  # the padding past the last block's bytes
    _count_launch(new, old, counts, bits).launch()
    return counts, bits


def delta_compact(new: torch.Tensor, old: torch.Tensor, counts: torch.Tensor, changed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: ``(idx, values)``: int32 ``[changed]`` positions of the words where ``new`` and
    ``old`` differ, ascending, and ``new``'s words there (``[changed]``, ``new``'s dtype).
    ``counts``: pass 1's (:func:`delta_count`), ``changed``: their sum."""
    _check(new, old, "delta_compact")
    nblocks = -(-new.numel() // DELTA_BLOCK)
    if counts.shape != (nblocks,) or counts.device != new.device:
        raise ValueError(f"delta_compact: counts must be [{nblocks}] on {new.device}, got "
                         f"{tuple(counts.shape)} on {counts.device}")
    c = counts.to(torch.int64)
    starts = torch.cumsum(c, 0) - c
    idx = torch.empty(changed, dtype=torch.int32, device=new.device)
    vals = torch.empty(changed, dtype=new.dtype, device=new.device)
    if changed:
        _compact_launch(new, old, starts, idx, vals).launch()
    return idx, vals


def delta_launch_configs(n: int = 3 * DELTA_BLOCK + 16) -> list[tuple[str, torch.dtype, DeltaLaunch]]:
    """``[(name, word dtype, launch)]``: every kernel and word dtype, as the wrappers build them,
    over CPU tensors of ``n`` words (nothing is launched; for the compile gate)."""
    out = []
    for wd in DELTA_WORDS:
        new, old = torch.zeros(n, dtype=wd), torch.zeros(n, dtype=wd)
        nblocks = -(-n // DELTA_BLOCK)
        counts = torch.zeros(nblocks, dtype=torch.int32)
        out.append(("count", wd, _count_launch(new, old, counts, torch.zeros(-(-n // 8), dtype=torch.uint8))))
        out.append(("compact", wd, _compact_launch(new, old, torch.zeros(nblocks, dtype=torch.int64),
                                                   torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=wd))))
    return out


def _flatnonzero(m: np.ndarray, count: int) -> np.ndarray:
    """``np.flatnonzero`` of a bool mask (a multiple of 8 long) with ``count`` set. Up to 1/8 set,
    in two steps: the 8-word groups with any set (each read as one uint64), then the words of
    those groups alone; at a few % set that is 2x numpy's, which tests word after word (and past
    ~15% set it is slower)."""
    if count * 8 > m.size:
        return np.flatnonzero(m)
    groups = m.view(np.uint64)
    g = np.flatnonzero(groups != 0)
    r = np.flatnonzero(groups[g].view(np.bool_))   # the set words' places in those groups' words
    q = np.take(g, r >> 3) << 3
    r &= 7
    r |= q
    return r


def _on_threads(fn, items: list) -> list:
    """``[fn(items[w::k]) for w in range(k)]``, each call on a thread of its own: ``k`` is torch's
    intra-op thread count (what torch's CPU ops would use), at most one a 4 items (chunks). numpy
    releases the GIL inside each call a chunk makes, so the threads run at once."""
    k = max(1, min(torch.get_num_threads(), len(items) // 4))
    if k == 1:
        return [fn(items)]
    with ThreadPoolExecutor(k) as pool:
        return list(pool.map(fn, [items[w::k] for w in range(k)]))


class TorchDeltaScan:
    """Compare and compact with torch (any device; also Triton's fallback for 2**31 words or more).

    Built from the two messages' words: ``changed``, the words that differ. ``compact()``: their
    positions (int64, ascending) and new values; ``write_bitmask(payload)``: the BITMASK section.

    On CPU (``cpu``) the words are read once, a chunk at a time, with numpy (torch's CPU compare and
    nonzero are each slower), on torch's thread count: each chunk of the message and of its
    snapshot is compared, counted, packed into ``bits`` (the BITMASK section, zero-padded to
    ``nmask`` bytes) and, where few of its words changed, compacted with its new and old words while
    it is in the core's cache. Gathering the changed words afterwards would read both messages from
    memory again: at a few % changed nearly every cache line holds one. A chunk of which more than
    1/8 changed is compacted only if ``compact_numpy()`` asks (``map_chunks`` runs a function over
    the chunks with their masks instead); for words of 2 and 4 bytes it counts instead its words
    that differ by more than 127 in the word's width (``far_at_least``: a lower bound of DIFF8's
    escapes, as a difference that wraps around the sign can look small but a small one never looks
    large)."""

    def __init__(self, nw: torch.Tensor, ow: torch.Tensor, nmask: int):
        self.nw, self.ow, self.nmask = nw, ow, nmask
        self.cpu = nw.device.type == "cpu"
        if self.cpu:
            self._scan_cpu(nw.numpy(), ow.numpy())
            return
        self.mask = nw != ow
        self.changed = int(torch.count_nonzero(self.mask))

    def _scan_cpu(self, a: np.ndarray, b: np.ndarray) -> None:
        n = a.size
        self.step = step = max(8, _CPU_CHUNK_BYTES // a.itemsize)   # a multiple of 8: chunks start bitmask bytes
        self.bits = np.zeros(self.nmask, dtype=np.uint8)
        self._compacted = None
        unsigned = _UNSIGNED.get(a.itemsize)
        # int32 positions where they fit: half the memory traffic of int64 in every later pass
        self.positions = positions = np.dtype(np.int32 if n < 2 ** 31 else np.int64)

        def scan(starts) -> list[tuple]:
            # per chunk with changes: (start, changed, far, positions, new words, old words); the last
            # three None where the chunk is left for compact_numpy()
            parts = []
            buf = np.empty(-(-min(n, step) // 8) * 8, dtype=np.bool_)
            t = np.empty(buf.size, dtype=a.dtype)
            for s in starts:
                e = min(n, s + step)
                m = buf[:-(-(e - s) // 8) * 8]          # whole bytes of the bitmask: the tail False
                m[e - s:] = False
                np.not_equal(a[s:e], b[s:e], out=m[:e - s])
                c = int(np.count_nonzero(m))
                if not c:
                    continue
                self.bits[s // 8:(e + 7) // 8] = np.packbits(m, bitorder="little")
                if c * _EAGER <= e - s:
                    i = _flatnonzero(m, c)
                    parts.append((s, c, 0, np.add(i, s, dtype=positions), a[s:e].take(i), b[s:e].take(i)))
                    continue
                far = 0
                if unsigned is not None:
                    d = np.subtract(a[s:e], b[s:e], out=t[:e - s])
                    np.add(d, 127, out=d)                # -127..127 -> 0..254, unless it wrapped
                    far = int(np.count_nonzero(np.greater(d.view(unsigned), 254, out=m[:e - s])))
                parts.append((s, c, far, None, None, None))
            return parts

        self._parts = sorted((p for ps in _on_threads(scan, list(range(0, n, step))) for p in ps), key=lambda p: p[0])
        self.changed = sum(p[1] for p in self._parts)
        self.far_at_least = sum(p[2] for p in self._parts)
        self._starts = [p[0] for p in self._parts]

    def map_chunks(self, fn, starts: list[int] | None = None) -> list:
        """CPU: ``[fn(start, end, mask) ...]`` for the chunks with changes (or those of ``starts``),
        in order, on the scan's threads; ``mask``: the chunk's changed words (bool, from ``bits``)."""
        n = self.nw.numel()

        def run(ss) -> list[tuple]:
            out = []
            for s in ss:
                e = min(n, s + self.step)
                m = np.unpackbits(self.bits[s // 8:(e + 7) // 8], count=e - s, bitorder="little").view(np.bool_)
                out.append((s, fn(s, e, m)))
            return out

        return [r for _, r in sorted((x for xs in _on_threads(run, self._starts if starts is None else starts)
                                      for x in xs), key=lambda x: x[0])]

    def compact_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CPU: ``(positions, new words, old words)`` of the changed words (numpy arrays, computed
        once; the positions ascending, of dtype ``positions``: int32 under 2**31 words)."""
        if self._compacted is None:
            a, b = self.nw.numpy(), self.ow.numpy()

            def late(s: int, e: int, m: np.ndarray) -> tuple:
                j = np.flatnonzero(m)
                return np.add(j, s, dtype=self.positions), a[s:e].take(j), b[s:e].take(j)

            todo = [p[0] for p in self._parts if p[3] is None]
            done = dict(zip(todo, self.map_chunks(late, todo), strict=True))
            cols = [(np.empty(0, dtype=self.positions), a[:0], b[:0])] + [done.get(p[0], p[3:]) for p in self._parts]
            self._compacted = tuple(np.concatenate(col) for col in zip(*cols, strict=True))
            self._parts = []
        return self._compacted

    def compact(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cpu:
            idx, new, _ = self.compact_numpy()
            return torch.from_numpy(idx).to(torch.int64), torch.from_numpy(new)
        idx = torch.nonzero(self.mask).view(-1)
        return idx, self.nw[idx]

    def write_bitmask(self, payload: torch.Tensor) -> None:
        if self.cpu:
            payload[:self.nmask] = torch.from_numpy(self.bits)
            return
        n = self.nw.numel()
        padded = torch.zeros(self.nmask * 8, dtype=torch.uint8, device=self.nw.device)
        padded[:n] = self.mask
        # Eight 0/1 bytes (an int64, little-endian) -> one byte, first byte lowest bit: the
        # product gathers byte i into bit 56 + i, with no carries between them.
        payload[:self.nmask] = ((padded.view(torch.int64) * _GATHER_BITS) >> 56).to(torch.uint8)


class TritonDeltaScan:
    """Compare and compact with this module's kernels (under 2**31 words): what :class:`TorchDeltaScan`
    gives, byte for byte. Pass 1 (here) counts the changed words per block and writes the bitmask
    (its bytes are the BITMASK section as they are); pass 2 (``compact()``) the changed words'
    positions (ascending, as nonzero gives them) and new values."""

    def __init__(self, nw: torch.Tensor, ow: torch.Tensor, nmask: int):
        self.nw, self.ow, self.nmask = nw, ow, nmask
        self.counts, self.bits = delta_count(nw, ow, nmask)
        self.changed = int(self.counts.sum())

    def compact(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx32, vals = delta_compact(self.nw, self.ow, self.counts, self.changed)
        return idx32.to(torch.int64), vals

    def write_bitmask(self, payload: torch.Tensor) -> None:
        payload[:self.nmask] = self.bits
