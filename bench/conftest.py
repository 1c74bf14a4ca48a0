"""The benchmark suite's terminal summary: after pytest-benchmark's own table (seconds per round),
one row per benchmark with what a newcomer asks first: GB/s, the memcpy GB/s measured in the same
session, their ratio, and what a round timed (see ``test_bench_refit.py``). Rows come from the
``refit_rows`` fixture, which the benchmarks fill with their ``extra_info`` when they measure
(``--benchmark-enable``); smoke runs (``--benchmark-disable``) add none, so CI prints nothing extra.
"""
import pytest

_ROWS = pytest.StashKey[list]()


def pytest_configure(config):
    config.stash[_ROWS] = []


@pytest.fixture
def refit_rows(request) -> list:
    """The summary's rows: append one ``extra_info``-like dict per measured benchmark."""
    return request.config.stash[_ROWS]


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own table
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(_ROWS, [])
    if not rows:
        return
    tr = terminalreporter
    tr.write_sep("-", "refit throughput (GB/s of destination bytes; memcpy measured in the same session)")
    head = ("case", "method", "median ms", "GB/s", "memcpy GB/s", "x memcpy", "timed")
    table = [head] + [(r["case"], r["method"], f"{r['seconds_median'] * 1e3:.2f}", f"{r['gbps']:.2f}",
                       f"{r['memcpy_gbps']:.2f}", f"{r['ratio_to_memcpy']:.2f}", r["timed"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        tr.write_line("  ".join(c.ljust(w) if i in (0, 1, 6) else c.rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    tr.write_line("Differs from `tritonreshard bench`: 5 rounds after 1 warm-up refit (not --repeats 10 "
                  "--warmup 2), each method's rounds in a row (not interleaved with the other methods').")
