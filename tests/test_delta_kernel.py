"""The delta codec's Triton compare-and-compact (``kernels.delta``) against its torch path.

``encode(..., backend="triton")`` on CPU tensors runs the two kernels in Triton's interpreter (exact,
slow: small messages, at most two blocks); the result must equal ``backend="torch"``'s byte for
byte: the same encoding chosen, the same payload. ``@pytest.mark.cuda`` repeats it compiled on large
messages (gap fillers, int32 indices, many blocks)."""
import pytest
import torch

from tritonreshard import kernels
from tritonreshard.transport import delta as D


def _same_encoding(old: torch.Tensor, new: torch.Tensor, word: int, backend=None, **kw) -> D.Encoded:
    ref = D.encode(new, old, word, backend="torch", **kw)
    got = D.encode(new, old, word, backend=backend or "triton", **kw)
    for f in ("kind", "nbytes", "words", "word", "changed", "entries"):
        assert getattr(got, f) == getattr(ref, f), (f, getattr(got, f), getattr(ref, f))
    assert (got.payload is None) == (ref.payload is None)
    if ref.payload is not None:
        assert torch.equal(got.payload, ref.payload), D.KINDS[ref.kind]
        base = old.clone()
        D.decode(got.kind, got.payload, base, word, got.entries)
        assert torch.equal(base, new)
    return got


def _changed(old: torch.Tensor, word: int, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    w = new.view(D.word_dtype(word))
    pick = torch.rand(w.numel(), generator=g) < frac
    w[pick] = w[pick] ^ 1
    return new


def _random(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_special_bit_patterns_match_torch():
    # -0.0 vs 0.0, two NaN payloads, subnormals: bits decide, and a NaN left alone is no change.
    f = torch.tensor([0.0, 1.0, float("nan"), 1e-45, 3.0, float("nan")], dtype=torch.float32)
    old = f.view(torch.uint8).clone()
    g = old.clone().view(torch.int32)
    g[0] = torch.tensor(-0.0).view(torch.int32)
    g[2] = 0x7FC00001
    g[3] = 2
    enc = _same_encoding(old, g.view(torch.uint8), 4, force_sparse=True)
    assert enc.changed == 3


def test_two_blocks_awkward_length_bitmask():
    # 4100 bf16 words: one full block and 4 words of a second; ~30% changed -> BITMASK, whose bytes
    # come from pass 1 as they are.
    old = _random(2 * (kernels.DELTA_BLOCK + 4), 1)
    enc = _same_encoding(old, _changed(old, 2, 0.3, 2), 2)
    assert enc.kind == D.BITMASK | D.DIFF8


def test_values_whole_and_as_differences_match_torch():
    # The kernels give the positions and values; the sections built from them equal torch's (two
    # kinds here: each interpreted encode runs both kernels; the bitmask is the test above's).
    old = _random(2 * 700, 6)
    new = _changed(old, 2, 0.1, 7)
    new.view(torch.int16)[::50] += 1000                   # escapes of DIFF8
    for kind in (D.GAP8, D.INDEX32 | D.DIFF8):
        assert _same_encoding(old, new, 2, kind=kind).kind == kind


@pytest.mark.parametrize("word,nwords,frac,force", [(1, 13, 0.2, True), (4, 1000, 0.01, False), (8, 37, 1.0, True)])
def test_words_and_fractions_match_torch(word, nwords, frac, force):
    old = _random(word * nwords, word)
    enc = _same_encoding(old, _changed(old, word, frac, 3), word, force_sparse=force)
    assert enc.changed > 0 and (force or enc.kind == D.GAP8 | D.DIFF8)


def test_none_changed():
    old = _random(2 * 999, 4)
    assert _same_encoding(old, old.clone(), 2).changed == 0
    enc = _same_encoding(old, old.clone(), 2, force_sparse=True)
    assert enc.kind != D.DENSE and enc.nbytes == 0


def test_passes_directly_and_bad_input():
    old = torch.arange(20, dtype=torch.int16)
    new = old.clone()
    new[[0, 9, 19]] = -1
    counts, bits = kernels.delta_count(new, old, 8)
    assert counts.tolist() == [3] and bits.tolist() == [1, 2, 8, 0, 0, 0, 0, 0]
    idx, vals = kernels.delta_compact(new, old, counts, 3)
    assert idx.dtype == torch.int32 and idx.tolist() == [0, 9, 19] and vals.tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match=r"dtype torch.float32.*old is torch.int16"):
        kernels.delta_count(new.float(), old)
    with pytest.raises(ValueError, match="bits_bytes=2"):
        kernels.delta_count(new, old, 2)
    with pytest.raises(ValueError, match="counts must be"):
        kernels.delta_compact(new, old, counts[:0], 3)
    with pytest.raises(ValueError, match="backend must be"):
        D.encode(new.view(torch.uint8), old.view(torch.uint8), 2, backend="cuda")


@pytest.mark.cuda
def test_compiled_matches_torch_on_large_messages(cuda_device):
    """The default backend on CUDA is Triton: equal to torch's bytes at every kind, with gap fillers
    and int32 indices, over many blocks."""
    n = 3 * 65535 + 11
    old = torch.zeros(2 * n, dtype=torch.uint8, device=cuda_device)
    new = old.clone()
    new.view(torch.int16)[:100] = 1
    new.view(torch.int16)[n - 1] = 2
    assert _same_encoding(old, new, 2, backend=None).entries == 103        # GAP16 with two fillers
    one = old.clone()
    one.view(torch.int16)[n - 1] = 5
    assert _same_encoding(old, one, 2, backend=None).kind == D.INDEX32     # one change, far away
    for word in (1, 2, 4, 8):
        big = _random(word * ((1 << 20) + 7), word).to(cuda_device)
        for frac in (0.0, 0.001, 0.03, 0.3, 1.0):
            _same_encoding(big, _changed(big.cpu(), word, frac, 7).to(cuda_device), word, backend=None)
