"""Delta detection on CPU: ``transport.delta.encode`` (compare and encode) against memcpy, per core.

A bf16 message of ``--mib`` MiB and its snapshot (the receiver's base), in three cases:

* ``adam``: the fp32 master weights (normal, std 0.02) take one Adam-like step at ``--lr`` (1e-6:
  the update ``lr * m / sqrt(v)``, a ratio in (-1, 1) per weight) and are rounded to bf16 again,
  so a realistic few % of the words change (2.8% at 1e-6, 17% at 1e-5), nearly all by one unit in
  the last place;
* ``zero``: nothing changed;
* ``all``: every word changed to an unrelated value (encode must find that ``DENSE`` wins);
* ``ulp``: every word changed by one unit in the last place (``BITMASK | DIFF8``; not a default).

Times are PROCESS CPU time (``time.process_time``: every thread of this process), not wall time:
the machines this runs on are shared, and CPU time is what a core spends whatever the others do.
GB/s per core = message bytes (one buffer, 1e9 bytes a GB) / CPU seconds, at ``--threads`` torch
threads (default 1: per core). ``memcpy`` is torch's ``dst.copy_(src)`` of the same bytes in the same
run. Each figure is the median of ``--repeat`` runs after one warm-up (the first touches fresh
memory). ``--json`` prints one JSON object with every row instead of the table.

    python bench/delta_detect.py --mib 64 256 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tritonreshard.transport import delta as dc

CASES = ("adam", "zero", "all")
_CHUNK = 1 << 24   # words generated at a time (bounds the fp32 temporaries at 1 GiB messages)


def message(case: str, mib: int, seed: int = 0, lr: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new, old)``: flat uint8 views of two bf16 messages of ``mib`` MiB (see the module docstring)."""
    n = mib * 2 ** 20 // 2
    g = torch.Generator().manual_seed(seed)
    old, new = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        w = torch.randn(e - s, generator=g) * 0.02
        old[s:e] = w
        if case == "adam":
            # Adam's step is lr * m_hat / (sqrt(v_hat) + eps): at most lr in size, of either sign
            m, v = torch.randn(e - s, generator=g), torch.randn(e - s, generator=g)
            new[s:e] = w - lr * m / torch.sqrt(m * m + v * v)
        elif case == "zero":
            new[s:e] = old[s:e]
        elif case == "all":
            new[s:e].view(torch.int16).copy_(old[s:e].view(torch.int16) ^ 0x5555)
        elif case == "ulp":
            new[s:e].view(torch.int16).copy_(old[s:e].view(torch.int16) + 1)
        else:
            raise ValueError(f"case must be one of {CASES + ('ulp',)}, got {case!r}")
    return new.view(torch.uint8), old.view(torch.uint8)


def cpu_seconds(fn, repeat: int) -> tuple[float, float, object]:
    """``(median CPU seconds, median wall seconds, last result)`` of ``fn()`` after one warm-up."""
    out = fn()
    cpu, wall = [], []
    for _ in range(repeat):
        t0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall), out


def measure(case: str, mib: int, repeat: int, lr: float = 1e-6) -> dict:
    """One row: ``encode`` of a ``case`` message of ``mib`` MiB, and memcpy of its bytes."""
    new, old = message(case, mib, lr=lr)
    nbytes = new.numel()
    dst = torch.empty_like(new)
    copy_cpu, _, _ = cpu_seconds(lambda: dst.copy_(new), repeat)
    enc_cpu, enc_wall, enc = cpu_seconds(lambda: dc.encode(new, old, 2), repeat)
    return {"case": case, "mib": mib, "lr": lr if case == "adam" else None, "threads": torch.get_num_threads(),
            "changed": enc.changed / enc.words,
            "kind": dc.KINDS[enc.kind], "encoded_fraction": enc.nbytes / nbytes,
            "encode_cpu_s": enc_cpu, "encode_wall_s": enc_wall, "encode_gbps": nbytes / enc_cpu / 1e9,
            "memcpy_cpu_s": copy_cpu, "memcpy_gbps": nbytes / copy_cpu / 1e9,
            "x_memcpy": copy_cpu / enc_cpu}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64, 256], help="message sizes in MiB")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES + ("ulp",))
    p.add_argument("--lr", type=float, default=1e-6, help="the adam case's learning rate")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: per core)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [measure(case, mib, a.repeat, a.lr) for mib in a.mib for case in a.cases]
    if a.json:
        print(json.dumps({"rows": rows, "unit": "GB/s per CPU second (1e9 bytes of message)"}, indent=1))
    else:
        print(f"{'case':5} {'MiB':>5} {'thr':>3} {'changed':>8} {'kind':14} {'sent':>7} "
              f"{'encode GB/s':>11} {'memcpy GB/s':>11} {'x memcpy':>8}")
        for r in rows:
            print(f"{r['case']:5} {r['mib']:5d} {r['threads']:3d} {100 * r['changed']:7.2f}% {r['kind']:14} "
                  f"{100 * r['encoded_fraction']:6.2f}% {r['encode_gbps']:11.3f} {r['memcpy_gbps']:11.2f} "
                  f"{r['x_memcpy']:8.3f}")
    return rows


if __name__ == "__main__":
    main()
