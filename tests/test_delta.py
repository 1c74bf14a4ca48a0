"""The delta codec (``tritonreshard.transport.delta``): exact in bits, never larger than dense.

Every check compares bytes: a base with the delta applied must equal the new bytes bit for bit,
including NaN payloads, -0.0 and subnormals (which compare equal or unequal by value in ways that
would hide or invent changes)."""
import pytest
import torch

from tritonreshard.transport import delta as D


def _apply(enc, old, new):
    """The receiver's side: the base (a copy of ``old``) after the encoded message."""
    base = old.clone()
    if enc.kind == D.DENSE:
        base.copy_(new)              # dense: the new bytes themselves travel
    else:
        assert enc.payload.numel() == enc.nbytes
        D.decode(enc.kind, enc.payload, base, enc.word, enc.entries)
    return base


def _roundtrip(old, new, word, **kw):
    enc = D.encode(new, old, word, **kw)
    got = _apply(enc, old, new)
    assert torch.equal(got, new), D.KINDS[enc.kind]
    if not kw.get("force_sparse"):
        assert enc.nbytes <= new.numel()   # never more than dense
    return enc


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8).clone()


def test_special_bit_patterns_are_changes_of_bits_not_of_values():
    # NaN payloads differ by bits; -0.0 == 0.0 and NaN != NaN by value: bits decide here.
    f = torch.tensor([0.0, 1.0, float("nan"), 1e-45, 3.0], dtype=torch.float32)
    old = _bits(f)
    g = old.clone().view(torch.int32)
    g[0] = torch.tensor(-0.0).view(torch.int32)          # 0.0 -> -0.0
    g[2] = 0x7FC00001                                    # another NaN payload
    g[3] = 2                                             # a subnormal -> another subnormal
    new = g.view(torch.uint8)
    for fs in (False, True):
        enc = _roundtrip(old, new, 4, force_sparse=fs)
        assert enc.changed == 3
    # A NaN that stays the same NaN is no change (value comparison would call it one).
    assert D.encode(old, old.clone(), 4).changed == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_random_changes_every_kind_and_word(dtype):
    g = torch.Generator().manual_seed(5)
    for n, frac in [(1, 1.0), (7, 0.5), (1000, 0.02), (4099, 0.3), (70001, 0.001), (50000, 0.97)]:
        old = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        new = old.clone()
        words = new.view(D.word_dtype(dtype.itemsize))
        pick = torch.rand(n, generator=g) < frac
        words[pick] = words[pick] ^ 1                    # flip the lowest bit: a one-ulp change
        for fs in (False, True):
            enc = _roundtrip(old, new, dtype.itemsize, force_sparse=fs)
            assert enc.changed == int(pick.sum())


def test_none_and_all_changed():
    old = torch.randint(0, 256, (2 * 5003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    enc = _roundtrip(old, old.clone(), 2)
    assert enc.kind != D.DENSE and enc.nbytes == 0 and enc.changed == 0   # nothing travels
    new = (old.view(torch.int16) + 1).view(torch.uint8)
    enc = _roundtrip(old, new, 2)
    assert enc.kind == D.DENSE and enc.changed == 5003 and enc.payload is None
    enc = _roundtrip(old, new, 2, force_sparse=True)
    assert enc.kind != D.DENSE


def test_long_unchanged_runs_need_gap_fillers():
    n = 3 * 65535 + 11
    old = torch.zeros(2 * n, dtype=torch.uint8)
    new = old.clone()
    w = new.view(torch.int16)
    w[:100] = 1
    w[n - 1] = 2                 # 196516 words after word 99: two fillers bridge the gap
    enc = _roundtrip(old, new, 2)
    assert enc.kind == D.GAP16 and enc.changed == 101 and enc.entries == 101 + 2
    w[:100] = 0
    w[n - 200:] = 3              # the first change 196416 words after the start: two fillers
    enc = _roundtrip(old, new, 2)
    assert enc.kind == D.GAP16 and enc.changed == 200 and enc.entries == 200 + 2


def test_choice_by_size():
    """GAP16 at a few % changed, BITMASK in the middle, DENSE near all: always the smallest."""
    g = torch.Generator().manual_seed(2)
    n = 1 << 16
    old = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=g)
    for frac, kind in [(0.02, D.GAP16), (0.3, D.BITMASK), (0.99, D.DENSE)]:
        new = old.clone()
        w = new.view(torch.int16)
        pick = torch.rand(n, generator=g) < frac
        w[pick] += 1
        enc = _roundtrip(old, new, 2)
        sizes = D.encoded_sizes(n, 2, enc.changed, enc.entries)
        assert enc.kind == kind and enc.nbytes == min(sizes.values()), (frac, sizes)


def test_adam_sized_bf16_step_is_about_five_percent_of_dense():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16)
    step = 1e-6 * torch.sign(torch.randn(w.shape, generator=g))
    new_w = (w.float() - step).to(torch.bfloat16)
    enc = _roundtrip(_bits(w), _bits(new_w), 2)
    frac = enc.changed / enc.words
    assert 0.005 < frac < 0.05 and enc.kind == D.GAP16
    assert enc.nbytes <= (2 + 2) * enc.entries + 8 and enc.nbytes < 0.1 * 2 * w.numel()


def test_word_size_and_bad_input():
    assert D.word_size(2, 4096, 128) == 2 and D.word_size(4, 6) == 2 and D.word_size(8, 8) == 8
    assert D.word_size(2, 3) == 1
    with pytest.raises(ValueError, match="word must be"):
        D.word_dtype(3)
    with pytest.raises(ValueError, match="flat uint8"):
        D.encode(torch.zeros(4, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="multiple of word"):
        D.encode(torch.zeros(5, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="kind must be"):
        D.decode(D.DENSE, torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), 2, 0)
    bad = torch.zeros(16, dtype=torch.uint8)
    bad[:2].view(torch.int16)[0] = 9                        # position 8 in a 4-word base
    with pytest.raises(ValueError, match="positions up to 8"):
        D.decode(D.GAP16, bad, torch.zeros(8, dtype=torch.uint8), 2, 1)
