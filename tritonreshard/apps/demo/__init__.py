"""``tritonreshard demo``: an asynchronous RL loop whose policy refits through tritonreshard.

Processes (spawned by the shared driver, :mod:`tritonreshard.apps.driver`, one per rank; global
ranks ``0..T-1`` train, ``T..T+I-1`` serve; each role has its own torch.distributed group)::

    trainers (FSDP rows, Shard(0))                 inference (tensor parallel, TP = I)
    ------------------------------                 -------------------------------------------
    all-gather rows -> forward/backward            generate rollouts on the serving weights,
    on trajectories from the queue                 every token: column-parallel gate_up,
    all-reduce grads, keep own rows                row-parallel down + all-reduce, vocab-
    tr.fence()    (readers acked newest)           parallel lm_head + all-gather
    optimizer.step() on tr.tensors (the arena)     at each rollout boundary (all TP ranks agree
    probe logits + weight digest of v -> store     through one MIN all-reduce): start_pull() the
    checkpoint of v (every trainer rank)           newest version in the background, keep
    tr.publish()  -> version v                     generating, swap() when every TP rank is done
            <---- trajectories (policy version, prompts, actions, rewards) via the TCPStore

The trainers' row shards *are* the arena tensors (``tr.tensors``): the optimizer updates them in
place and ``publish()`` only bumps a version, so no copy happens per step on the trainer side.
Trajectories carry the version that generated them; a trainer at version ``v`` drops any older than
``v - max_staleness``.

Verification (exact by construction): after every refit, the inference ranks all-gather their TP
shards into full weights (pure copies, so bit-identical to the global tensors) and the first
inference rank runs :func:`.policy.probe`, a dense CPU float32 single-threaded forward
on fixed probe inputs. The trainers all-gather their row shards of the same version and run the
very same function, publishing a SHA-1 of the weight bytes and the probe logits' bytes. The
inference side compares both bit for bit: equal digests mean every element of every parameter
arrived in the right place with the right bits, and equal logits show the served model computes
the trainer's function. The tensor-parallel forward itself sums partial products in a different
order, so its difference to the dense logits is reported (``tp_max_abs_diff``), not asserted.

Numbers (a summary line, then with ``--json`` a JSON object as the last line, both on stdout):
``refit_ms_p50`` is the median time of a pull, start to ack (``last_pull.total_ms`` of the slowest
TP rank); ``max_inference_stall_ms`` the longest time generation paused for a refit (shadow: the
``swap()``; in-place: the whole ``pull()``); the verification gather and probe are instrumentation
and not counted. ``bytes_per_refit`` sums the bytes every inference rank writes per refit;
``staleness_max`` is the largest ``v - version`` of a trajectory the trainers used;
``staging_bytes`` the extra memory the pulls allocated, as the engine measured it (the most one
pull took, summed over the TP ranks); ``inference_pids`` the inference processes' ids.

Faults (``--fault``, see its help): a rank's failure makes the driver set an ``abort`` key that
ranks waiting on the store poll; ranks blocked in a collective get gloo's "connection closed" at
once; the engine raises PeerDiedError in fences and pulls. The inference group decides at each
rollout boundary through its MIN all-reduce whether every TP rank's pull succeeded and nothing
aborted: if not, the group settles its pull (installed if every TP rank's pull completed, else
discarded on every rank: the fault contract of docs/guarantees.md), verifies what it serves (digest
against the trainers' digest of that version) and records it and why, then exits. Survivors get ``--peer-timeout``
+ 10 s to exit on their own before the driver terminates them. Each failed rank is reported in one
line (``TRITONRESHARD_DEBUG=1`` prints the ranks' tracebacks too).

Restarts (``--restart``): when only trainers failed, the driver stops what is left of the trainer
group and starts new trainer processes in the refit group's next epoch; they load the newest
checkpoint every trainer rank wrote (each rank checkpoints a version before publishing it, so the
checkpoint is never older than what the inference group holds) and publish from the next version
on. The inference processes settle the pull in flight together (the same contract), keep generating on their last
complete version, and ``rejoin()`` the new epoch once its trainers are up; refits go on, verified as before.
``recoveries`` counts the restarts, ``recovery_ms`` is the time from the failure to the first
refit of the new epoch, and ``recovery_parts_ms`` splits it (detect, stop, launch, resume,
step, refit). The new trainers run in spare processes the driver started once every rank was up (torch and tritonreshard
already imported: ``recovery_launch`` is ``"standby"``), so a restart skips the interpreter's start and the imports.

Entry points (wired by ``apps/cli.py``): :func:`add_arguments` and :func:`run`.

Modules, one job each: :mod:`.cli` (options, checks, :func:`run`), :mod:`.config` (what every rank
gets), :mod:`.driver` (spawn, watch, restart, stop the ranks), :mod:`.trainer` and
:mod:`.inference` (the two process bodies), :mod:`.verify` (probes and digests), :mod:`.faults`
(injected faults and the trainers' checkpoints), :mod:`.report` (summary, JSON, picture) and
:mod:`.policy` (the model, its forwards and the task).
"""
from .cli import add_arguments, run

__all__ = ["add_arguments", "run", "SUMMARY_KEYS", "FAILURE_KEYS"]


def __getattr__(name: str):
    # The report's keys load with the report (and torch): ``tritonreshard --help`` needs only add_arguments.
    if name in ("SUMMARY_KEYS", "FAILURE_KEYS"):
        from . import report  # lazy: see the comment above
        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
