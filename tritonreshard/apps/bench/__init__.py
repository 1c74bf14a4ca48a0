"""``tritonreshard bench``: refit throughput of the engine against memcpy and two baselines.

What moves: a Llama-shaped bf16 state dict of ``--size`` bytes (``qkv``, ``o``, ``gate_up``,
``down``, two norms per layer, embedding, lm_head, final norm; layers and hidden size scale with the
size, the embedding absorbs the rest) from trainer processes to inference processes. Layouts
(``--layout``)::

    fsdp-tp             T trainers Shard(0) (FSDP rows)  ->  I inference ranks, tensor parallel:
                        qkv Shard(0, blocks=(h,h,h)), gate_up Shard(0, blocks=(i,i)), o/down Shard(1),
                        embed/lm_head Shard(0) (vocab parallel), norms Replicate
    cols-replicas       T trainers Shard(1) (column shards)  ->  I ranks holding every tensor whole
    colocated           the fsdp-tp layouts on the same processes (ranks 0..max(T,I)-1 are trainer
                        and/or inference; one RefitEndpoint with both sides per process)
    replicated-sources  T trainers as DP x FSDP, mesh [[0..T/2-1],[T/2..T-1]] [Replicate(), Shard(0)]
                        ->  I ranks tensor parallel
    megatron-tp-pp      T trainers as Megatron-Core TP 2 x PP T/2 (rank = tp + 2 * stage; layers in
                        blocks per stage, embed on the first, lm_head and norm on the last; qkv rows
                        Shard(0), the rest as fsdp-tp's TP)  ->  I ranks tensor parallel. Here
                        gather_broadcast is the Megatron-Bridge-style export: each tensor gathered
                        on its stage's first rank, then broadcast

Methods, all on the same bytes in one run (destination bytes = the sum of every inference rank's
local shards):

* ``memcpy``: the driver process copies that many bytes (all cores, torch's threads), in ``copy_``
  calls of at most 256 MiB (far beyond any cache, and the driver does not hold twice the bytes a
  refit writes): the machine's speed of light.
* ``tritonreshard``: ``RefitEndpoint``: trainers ``publish()``, every inference rank ``pull()``s.
* ``p2p``: ``torch.distributed.batch_isend_irecv`` over the same plan's ops (gloo on CPU, NCCL on
  GPU): sources send each op's slice (packed when not contiguous), destinations receive into a
  temporary (or straight into a contiguous destination slice) and copy into the shard.
* ``gather_broadcast``: per tensor, gather the full tensor on the first trainer, broadcast it to
  every inference rank, each inference rank copies out its shard (the serialized flow).

Timing of one refit: trainers write the next version's weights (untimed), every rank meets in a gloo
barrier, reads ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine),
runs the method and reads the clock again; the refit's time is max(end) - min(start) over all ranks.
``seconds`` is the median over ``--repeats`` refits after ``--warmup``. For ``tritonreshard``,
``coordination_ms`` is the median of (refit time - the slowest inference rank's copy), the copy as
the engine measures it (``last_pull.copy_ms``: its descriptor-table copy, device sync included), and
``staging_bytes`` the extra memory the pulls allocated as the engine measured it (``staging_bytes``
of each rank: the most one pull took), summed over the ranks.

Codec (``--codec``, with ``--hosts`` >= 2): how the engine's cross-host messages travel, in the
library's string spelling (``delta=``). ``off`` (the default here: ``trs.Dense()``, every byte
every refit), ``auto`` (``trs.Delta()``, the library's default: a delta where finding what changed
costs less than sending whole, as each trainer measures its link and its detection) or ``always``
(``trs.Delta(force=True)``: a delta every refit after the first, whole every 64: the anchor). The
default is ``off`` because the provenance bits below change every element every refit, by a
version key that a delta compresses to about 56% (a bitmask and one int8 difference per element):
with a delta the plain run would time the encoder on a change no training step makes. The table
and the JSON (``"codec"``) name the run's codec; ``--update-lr`` (:mod:`.deltas`) runs all three
on RL-sized updates instead.

Provenance: every element's bf16 bits are a hash of (tensor name, global index) XOR a key of the
version, with the top exponent bit clear (finite values). Every refit changes every weight, so after
the timed refits each inference rank checks its shards bit for bit: a stale, misplaced or unwritten
element fails ``verified``.

Memory: before any process starts, :func:`.memory.estimate` adds up what every rank will allocate
(arenas, the engine's buffer sets, each baseline's destination set and staging, the driver's copy
buffers, the processes themselves) and ``tritonreshard bench`` refuses a run that would not fit,
naming the estimate, what is available and a ``--size`` that fits.

Processes: the shared driver (:mod:`tritonreshard.apps.driver`) hosts a TCPStore and spawns one
process per rank (``torch.set_num_threads(1)``); ranks run commands from the store
(:class:`BenchSession`, also used by ``bench/test_bench_refit.py``) so one set-up serves many
measurements. Entry points for ``tritonreshard bench``: :func:`add_arguments` and :func:`run`.

Modules, one job each: :mod:`.cli` (options, checks, :func:`run`), :mod:`.config`
(:class:`BenchConfig`, ``--size``, ``--link-gbps``, ``--codec``'s values), :mod:`.model` (the model
and its layouts), :mod:`.provenance` (the bits every element holds), :mod:`.baselines` (p2p and
gather_broadcast), :mod:`.rank` (one rank's set-up and command loop), :mod:`.session`
(:class:`BenchSession`, memcpy), :mod:`.memory` (the peak estimate and the refusal) and
:mod:`.report` (the JSON object and the table).
"""
from .cli import add_arguments, run
from .config import BenchConfig, parse_size

__all__ = ["add_arguments", "run", "BenchConfig", "BenchSession", "parse_size", "measure", "memcpy_seconds"]


def __getattr__(name: str):
    # The measuring side loads with torch, on first use: ``tritonreshard --help`` needs only add_arguments.
    if name == "measure":
        from .report import measure  # lazy: see the comment above
        return measure
    if name in ("BenchSession", "memcpy_seconds"):
        from . import session  # lazy: see the comment above
        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
