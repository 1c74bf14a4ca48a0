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
    if not kw.get("force_sparse") and kw.get("kind") is None:
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


SPARSE = sorted(k for k in D.KINDS if k != D.DENSE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_random_changes_every_kind_and_word(dtype):
    """Every sparse kind the word allows decodes to the new bytes; the chosen one is the smallest."""
    g = torch.Generator().manual_seed(5)
    word = dtype.itemsize
    for n, frac in [(1, 1.0), (7, 0.5), (1000, 0.02), (4099, 0.3), (70001, 0.001), (50000, 0.97)]:
        old = torch.randint(0, 256, (n * word,), dtype=torch.uint8, generator=g)
        new = old.clone()
        words = new.view(D.word_dtype(word))
        pick = torch.rand(n, generator=g) < frac
        words[pick] = words[pick] ^ 1                    # flip the lowest bit: a one-ulp change
        some = pick & (torch.rand(n, generator=g) < 0.2)
        words[some] = words[some] ^ 0x40                 # and a few that do not fit an int8 difference
        for fs in (False, True):
            enc = _roundtrip(old, new, word, force_sparse=fs)
            assert enc.changed == int(pick.sum())
        sizes = {}
        for kind in SPARSE:
            if kind & D.DIFF8 and word not in (2, 4):
                continue
            enc = _roundtrip(old, new, word, kind=kind)
            assert enc.kind == kind and enc.nbytes == enc.payload.numel()
            sizes[kind] = enc.nbytes
        assert D.encode(new, old, word).nbytes == min(min(sizes.values()), n * word)


def test_diff8_escapes_at_the_edges_of_int8_and_of_the_word():
    """Differences of -127..127 travel as one byte; -128, 128 and wraps across the word's sign (0x7FFF
    -> 0x8000 is not a difference of one) travel whole. Both words DIFF8 is offered for."""
    for wd, top in ((torch.int16, 2 ** 15 - 1), (torch.int32, 2 ** 31 - 1)):
        old = torch.tensor([0, 0, 0, 0, 5, top, -top - 1, top, -1, 100, 7, 0], dtype=wd)
        new = torch.tensor([127, -127, 128, -128, 5, -top - 1, top, top - 127, 0, -27, 7, 1], dtype=wd)
        word = wd.itemsize
        ob, nb = old.view(torch.uint8), new.view(torch.uint8)
        for kind in SPARSE:
            if kind & D.DIFF8:
                enc = _roundtrip(ob, nb, word, kind=kind)
                # 10 changed, 4 escaped: 128, -128 and the two wraps (-127, 127 and the rest fit)
                assert enc.changed == 10 and enc.nbytes == D.encoded_sizes(12, word, 10, escapes=4)[kind], D.KINDS[kind]


def test_none_and_all_changed():
    old = torch.randint(0, 256, (2 * 5003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    enc = _roundtrip(old, old.clone(), 2)
    assert enc.kind != D.DENSE and enc.nbytes == 0 and enc.changed == 0   # nothing travels
    new = (old.view(torch.int16) + 1).view(torch.uint8)      # every word one step: a bit and a byte each
    enc = _roundtrip(old, new, 2)
    assert enc.kind == D.BITMASK | D.DIFF8 and enc.changed == 5003 and enc.nbytes == 632 + 5008
    new = (old.view(torch.int16) ^ 0x5555).view(torch.uint8)  # every word far off: whole
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
    w[n - 1] = 2                 # 196516 words after word 99: two uint16 fillers bridge the gap
    enc = _roundtrip(old, new, 2)
    assert enc.kind == D.GAP16 | D.DIFF8 and enc.changed == 101 and enc.entries == 101 + 2
    enc = _roundtrip(old, new, 2, kind=D.GAP8)
    assert enc.entries == 101 + (n - 1 - 100) // 255        # one uint8 filler per 255 words
    w[:100] = 0
    w[n - 200:] = 3              # the first change 196416 words after the start: two fillers
    enc = _roundtrip(old, new, 2)
    assert enc.kind == D.GAP16 | D.DIFF8 and enc.changed == 200 and enc.entries == 200 + 2


def test_choice_by_size():
    """One-ulp changes: uint8 gaps and int8 differences at a few %, the bitmask with them in the
    middle and up to nearly all; changes to random values: their words whole, or dense."""
    g = torch.Generator().manual_seed(2)
    n = 1 << 16
    old = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=g)
    for frac, ulp, kind in [(0.02, True, D.GAP8 | D.DIFF8), (0.3, True, D.BITMASK | D.DIFF8),
                            (0.99, True, D.BITMASK | D.DIFF8), (0.02, False, D.GAP8),
                            (0.3, False, D.BITMASK), (0.99, False, D.DENSE)]:
        new = old.clone()
        w = new.view(torch.int16)
        pick = torch.rand(n, generator=g) < frac
        w[pick] = w[pick] + 1 if ulp else w[pick] ^ 0x5555
        enc = _roundtrip(old, new, 2)
        ow = old.view(torch.int16)
        escapes = int(((w.int() - ow.int()).abs() > 127).sum())
        idx = torch.nonzero(pick).view(-1)
        gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
        sizes = D.encoded_sizes(n, 2, enc.changed, gap16=enc.changed + int(((gaps - 1) // 65535).sum()),
                                gap8=enc.changed + int(((gaps - 1) // 255).sum()), escapes=escapes)
        assert enc.kind == kind and enc.nbytes == min(sizes.values()), (frac, ulp, D.KINDS[enc.kind], sizes)


def test_adam_sized_bf16_step_is_under_five_percent_of_dense():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1 << 18, generator=g) * 0.02             # the fp32 master weights
    step = 1e-6 * torch.sign(torch.randn(w.shape, generator=g))
    old, new = _bits(w.to(torch.bfloat16)), _bits((w - step).to(torch.bfloat16))
    enc = _roundtrip(old, new, 2)
    frac = enc.changed / enc.words
    assert 0.005 < frac < 0.05 and enc.kind == D.GAP8 | D.DIFF8, (frac, D.KINDS[enc.kind])
    # one byte of gap and one of difference per changed element (plus a few fillers and escapes)
    assert enc.nbytes < 2.2 * enc.changed + 64 and enc.nbytes < 0.05 * new.numel()


def test_word_size_and_bad_input():
    assert D.word_size(2, 4096, 128) == 2 and D.word_size(4, 6) == 2 and D.word_size(8, 8) == 8
    assert D.word_size(2, 3) == 1
    with pytest.raises(ValueError, match="word must be"):
        D.word_dtype(3)
    with pytest.raises(ValueError, match="flat uint8"):
        D.encode(torch.zeros(4, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="multiple of word"):
        D.encode(torch.zeros(5, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="kind=9 is not one of"):
        D.encode(torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), 1, kind=D.BITMASK | D.DIFF8)
    with pytest.raises(ValueError, match="kind must be"):
        D.decode(D.GAP8 | D.DIFF8, torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), 8, 0)
    with pytest.raises(ValueError, match="kind must be"):
        D.decode(D.DENSE, torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), 2, 0)
    bad = torch.zeros(16, dtype=torch.uint8)
    bad[:2].view(torch.int16)[0] = 9                        # position 8 in a 4-word base
    with pytest.raises(ValueError, match="positions up to 8"):
        D.decode(D.GAP16, bad, torch.zeros(8, dtype=torch.uint8), 2, 1)
    old = torch.zeros(64, dtype=torch.uint8)
    new = old.clone()
    new[10] = 1
    enc = D.encode(new, old, 2)
    with pytest.raises(ValueError, match="payload bytes where"):   # cut short: the base is left alone
        D.decode(enc.kind, enc.payload[:-1], old, 2, enc.entries)
    assert not old.any()
