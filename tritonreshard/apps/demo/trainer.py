"""A trainer process of the demo: FSDP row shards that *are* the refit arena.

Each step: take the next fresh enough trajectory batch from the store, forward/backward on the
all-gathered weights, all-reduce the gradient and keep its own rows, ``fence()`` (every inference
rank finished reading the current version), ``optimizer.step()`` straight into the arena, then
checkpoint and probe the new version and ``publish()`` it.
"""
from __future__ import annotations

import json
import pickle
import time

import torch

from tritonreshard import Meeting, PeerDiedError, RefitTrainer, Timeouts

from ..driver import wait_key
from .config import RunConfig
from .faults import fault_at, kill_self, last_checkpoint, load_checkpoint, save_checkpoint
from .policy import Comm, PolicyConfig, gather_full, group_advantages, init_params, policy_loss, trainer_layouts
from .verify import publish_probe

__all__ = ["run_trainer"]

TGROUP = None  # the trainers' collectives run on their role's default process group (this epoch's)


def run_trainer(rank: int, rc: RunConfig, refit_store, dstore, epoch: int, device: torch.device) -> None:
    """Trainer ``rank`` of trainer-group ``epoch`` (0, then one more per restart): trains
    ``rc.steps`` steps (or what is left of them after the newest checkpoint) and publishes every
    version; returns once every inference rank has closed its endpoint."""
    cfg = PolicyConfig()
    comm = Comm(device, rc.comm_backend)
    src_layouts = trainer_layouts(cfg, rc.trainer_ranks)
    resume, ckpt, local = _starting_point(rank, rc, epoch, cfg, src_layouts, device)
    if rank == 0:
        dstore.set(f"trainers_up/{epoch}", "1")  # the inference group joins this epoch now

    # A restarted group resumes the version numbering: its first publish() is resume + 1.
    tr = RefitTrainer(local, src_layouts, Meeting(rank=rank, world_size=rc.world_size, store=refit_store, epoch=epoch),
                      timeouts=Timeouts(wait=rc.timeout, peer=rc.peer_timeout), start_version=resume or 0)
    dstore.set(f"resumed/{epoch}/{rank}", repr(time.time()))  # a restart's breakdown: checkpoint loaded, group met
    try:
        # Train on the arena tensors themselves: Parameter(t) shares t's storage, and Adam updates
        # in place, so every optimizer step writes straight into the published buffers.
        params = {n: torch.nn.Parameter(tr.tensors[n]) for n in src_layouts}
        for n, p in params.items():
            assert p.data_ptr() == tr.tensors[n].data_ptr()
        opt = torch.optim.Adam(params.values(), lr=rc.lr)
        if ckpt is None:
            version = tr.publish()
            full = gather_full(src_layouts, tr.tensors, rank, TGROUP, comm)
            if rank == 0:
                publish_probe(dstore, cfg, version, full)
            first_step, queue, dropped, published = 1, 0, 0, True
        else:
            # The inference group serves resume or resume - 1 and pulls resume + 1 next (the probe
            # of resume is in the store already: it was written before resume was published).
            opt.load_state_dict(ckpt["optimizer"])
            version, queue, dropped = resume, ckpt["queue"], ckpt["dropped"]
            full = gather_full(src_layouts, tr.tensors, rank, TGROUP, comm)
            first_step, published = resume, False
        for step in range(first_step, rc.steps + 1):
            if rank == rc.trainers - 1 and fault_at(rc, "crash-trainer", step) and epoch == 0:
                raise RuntimeError(f"injected failure (--fault crash-trainer:{step})")
            t_step = time.perf_counter()
            batch, queue, dropped, staleness = _next_batch(dstore, tr, rc, queue, dropped, version)
            loss, rewards = _gradients(rank, rc, comm, device, src_layouts, params, full, batch)
            if published:
                tr.fence()  # every inference rank finished reading `version`: now it may change
            opt.step()
            nxt = version + 1
            # Before publishing nxt: its probe (so whoever installs nxt can verify it, even if this
            # rank dies right after publishing) and every rank's checkpoint of it (so a restarted
            # group resumes at or after anything the inference group can hold).
            full = gather_full(src_layouts, tr.tensors, rank, TGROUP, comm)
            save_checkpoint(rc, rank, nxt, {
                "params": {n: t.detach().cpu().clone() for n, t in tr.tensors.items()},
                "optimizer": opt.state_dict(), "queue": queue, "dropped": dropped})
            if rank == 0:
                publish_probe(dstore, cfg, nxt, full)
                _report_step(dstore, rc, step, {
                    "step": step, "version": nxt, "reward": float(rewards.mean()), "epoch": epoch,
                    "batch_version": batch["version"], "staleness": staleness, "dropped": dropped,
                    "loss": loss.item(), "step_ms": 1e3 * (time.perf_counter() - t_step)})
            version = tr.publish()
            if rank == 0 and epoch > 0 and not published:  # a restart's breakdown: its first version out
                dstore.set(f"published/{epoch}", repr(time.time()))
            published = True
            assert version == nxt, (version, nxt)
            if rank == 0 and epoch == 0 and fault_at(rc, "kill-trainer", version):
                # Land the kill while the inference group pulls `version` (it has swapped in
                # version - 1 by then): it serves `version` if every TP rank's pull completed
                # first, else version - 1 (the fault contract, docs/guarantees.md).
                wait_key(dstore, f"pull_started/{version}", rc.timeout)
                kill_self(dstore, rank, rc)
        tr.fence()  # the last version is read by everyone before the arena goes away
        dstore.add("trainers_done", 1)
        # Keep the arena alive until every inference rank has closed its endpoint.
        wait_key(dstore, "inference_closed", rc.timeout)
    finally:
        tr.close()


def _starting_point(rank: int, rc: RunConfig, epoch: int, cfg: PolicyConfig, src_layouts, device: torch.device):
    """``(resume, ckpt, local)``: the version a restarted group resumes from (None for epoch 0), its
    checkpoint (None: a fresh start), and this rank's row shards on ``device``, from the seed or the
    checkpoint."""
    resume = last_checkpoint(rc) if epoch > 0 else None
    if epoch > 0 and resume is None:
        raise RuntimeError(f"trainer epoch {epoch}: no complete checkpoint in {rc.checkpoint_dir} to restart from")
    if resume is None:
        full0 = init_params(cfg, rc.seed)
        return None, None, {n: lay.shard(full0[n], rank).to(device) for n, lay in src_layouts.items()}
    ckpt = load_checkpoint(rc, resume, rank)
    return resume, ckpt, {n: t.to(device) for n, t in ckpt["params"].items()}


def _report_step(dstore, rc: RunConfig, step: int, stats: dict) -> None:
    """Rank 0's record of a finished step (and, after the last, the final version) in the store."""
    dstore.set(f"step/{step}", json.dumps(stats))
    if step == rc.steps:
        dstore.set("final_version", str(stats["version"]))
    dstore.add("steps_done", 1)


def _next_batch(dstore, tr, rc: RunConfig, queue: int, dropped: int, version: int):
    """The next trajectory batch at most ``rc.max_staleness`` versions old; returns (batch, queue,
    dropped, staleness). Every trainer reads the same queue in the same order and applies the same
    rule, so they always pick the same batch without talking to each other."""
    while True:
        key = f"traj/{queue}"
        wait_key(dstore, key, rc.timeout, check=lambda: _check_readers(tr))
        batch = pickle.loads(dstore.get(key))
        queue += 1
        staleness = version - batch["version"]
        if staleness <= rc.max_staleness:
            return batch, queue, dropped, staleness
        dropped += 1


def _gradients(rank: int, rc: RunConfig, comm, device, src_layouts, params, full, batch):
    """Forward/backward on the all-gathered weights ``full`` (overlaps the inference pulls of the
    current version); sets each parameter's ``grad`` to this rank's rows of the global gradient.
    Returns (loss, the batch's rewards)."""
    per = rc.prompts // rc.trainers * rc.group
    rows = slice(rank * per, (rank + 1) * per)  # this trainer's slice of every batch
    prompts = torch.from_numpy(batch["prompts"]).long()[rows].to(device)
    actions = torch.from_numpy(batch["actions"]).long()[rows].to(device)
    rewards = torch.from_numpy(batch["rewards"])
    adv = group_advantages(rewards, rc.group)[rows].to(device)

    leaves = {n: t.to(device).requires_grad_() for n, t in full.items()}
    loss = policy_loss(leaves, prompts, actions, adv, denom=rewards.numel())
    loss.backward()
    # Reduce-scatter, spelled out (gloo has none): one all-reduce over the flat gradient, then each
    # rank keeps its own rows.
    flat = torch.cat([leaves[n].grad.reshape(-1) for n in src_layouts])
    flat = comm.all_reduce(flat, TGROUP)
    off = 0
    for n, lay in src_layouts.items():
        g = flat[off:off + lay.numel].view(lay.shape)
        off += lay.numel
        params[n].grad = lay.shard(g, rank).to(device)
    return loss, rewards


def _check_readers(tr) -> None:
    """Raises PeerDiedError if a rank of the refit group died (the engine's liveness call: no wait)."""
    dead = tr.dead_peers()
    if dead:
        # The group's own reasons name each rank with its pid, as the engine's waits do.
        reasons = [tr.group.liveness.dead_reason(r) or f"rank {r} died" for r in dead]
        raise PeerDiedError(dead[0], "; ".join(reasons))
