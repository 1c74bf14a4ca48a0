"""LoRA adapters refitted in place into vLLM's LoRA slots: no adapter file, scaling once per version.

Trainer side: :class:`LoraTrainer` (a :class:`~tritonreshard.RefitTrainer` publishing the adapter's
A/B factors in PEFT's names, ``trs.recipes.lora_to_vllm(...).src``). Worker side:
:class:`LoraWorkerExtension` (vLLM's ``worker_extension_cls``), whose ``init_lora_refit`` registers the
adapter once with vLLM's own manager (zeros, pinned in its slot, so vLLM never reloads it from a
path) and whose ``update_lora`` pulls a version into shadow buffers, agrees over the TP group, then
writes every slot view in place and folds the scaling into ``lora_B`` once, as vLLM's loader does.
Driver: :func:`lora_init_info`, :func:`setup_lora_refit` (checks the adapter against the engine
before any worker is asked), :func:`refit_lora` (which also resets the prefix cache: vLLM keys cached
KV blocks by the adapter's name and path only). The worker methods never raise: vLLM 0.32's
executor stops reading replies at the first failed rank, so each returns its outcome and the
driver functions raise. Importing this module does not import vLLM.
"""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from .. import RefitTrainer, recipes
from ..serving import SRC_DTYPES, ServingInit, join_as_trainer, rank_problems, serving_rank, src_dtype_problems
from . import WorkerExtension

__all__ = ["LoraTrainer", "LoraWorkerExtension", "LORA_WORKER_EXTENSION", "LORA_TIMEOUT", "lora_init_info",
           "setup_lora_refit", "refit_lora"]

LORA_WORKER_EXTENSION = f"{__name__}.LoraWorkerExtension"


def _adapter_dict(lora_config) -> dict:
    """A ``peft.LoraConfig`` (or its dict) as plain JSON data (sets become sorted lists): it crosses
    vLLM's RPC and feeds vLLM's ``PEFTHelper``."""
    raw = lora_config if isinstance(lora_config, dict) else lora_config.to_dict()
    return json.loads(json.dumps(raw, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


#: The LoRA refit's default ``timeout`` (seconds; trainers and engine workers): the trainers meet the
#: workers only once the engine has started, which took 35-69 s on 2 shared CPU cores in issue 41's
#: runs (the general 60 s would expire first). A dead peer is still noticed by its heartbeat (``peer_timeout``, 10 s).
LORA_TIMEOUT = 300.0


def lora_init_info(lora_config, *, lora_name: str, lora_id: int, store: str, trainer_ranks, inference_ranks,
                   src_dtype: str = "float32", fsdp: bool = False, group: str = "vllm-lora",
                   timeout: float = LORA_TIMEOUT) -> dict:
    """The plain dict for ``collective_rpc("init_lora_refit", kwargs={"info": ...})``: the adapter
    (``lora_config``: a ``peft.LoraConfig`` or its dict), the ``LoRARequest`` name and id requests
    will use, and the refit group (as :func:`tritonreshard.vllm.init_info`). ``timeout``: the
    workers' wait for the trainers at set-up and the default of each pull (:data:`LORA_TIMEOUT`)."""
    problems = []
    if not isinstance(lora_name, str) or not lora_name:
        problems.append(f"lora_name={lora_name!r} must be a non-empty str")
    if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
        problems.append(f"lora_id={lora_id!r} must be an int >= 1 (vLLM's LoRARequest)")
    problems += src_dtype_problems(src_dtype) + rank_problems(trainer_ranks, inference_ranks)
    if problems:
        raise ValueError("lora_init_info: " + "; ".join(problems))
    return {"adapter": _adapter_dict(lora_config), "lora_name": lora_name, "lora_id": lora_id, "store": store,
            "trainer_ranks": [int(r) for r in trainer_ranks], "inference_ranks": [int(r) for r in inference_ranks],
            "src_dtype": src_dtype, "fsdp": bool(fsdp), "group": group, "timeout": float(timeout)}


def _adapter_tensors(tensors, adapter_name: str) -> dict:
    """``{PEFT saved name: tensor}`` of a ``peft`` model's LoRA parameters (the parameters themselves,
    so that the trainer binds them; ``...lora_A.{adapter}.weight`` is saved as ``...lora_A.weight``,
    as ``get_peft_model_state_dict`` names it), or ``tensors`` as given when they are a dict."""
    if not isinstance(tensors, torch.nn.Module):
        return tensors if isinstance(tensors, dict) else {}
    out = {}
    for name, p in tensors.named_parameters():
        for kind in ("lora_A", "lora_B"):
            if f".{kind}.{adapter_name}." in name:
                out[name.replace(f".{kind}.{adapter_name}.", f".{kind}.")] = p
    return out


class LoraTrainer(RefitTrainer):
    """Trainer side: this rank's adapter, published to the vLLM workers' LoRA slots.

    ``tensors``: the ``peft`` model itself (its LoRA parameters of adapter ``adapter_name``), or
    ``{PEFT saved name: tensor}`` (the names ``peft.get_peft_model_state_dict`` gives; whole or,
    with ``fsdp=True``, this rank's ``Shard(0)`` rows). Every ``nn.Parameter`` (or ``requires_grad``
    leaf) given is *bound*: re-pointed at the trainer's shared buffer (``param.data``), so that
    ``optimizer.step()`` on the model writes what ``publish()`` publishes, with no copy. Any other
    tensor is copied into the buffer once: train ``tensors`` then. ``publish()`` raises
    ``ValueError`` naming each given tensor that was written after that copy (e.g. the detached
    ``get_peft_model_state_dict`` tensors, whose parameters an optimizer stepped: those steps would
    never be published) or each bound parameter re-pointed elsewhere since.

    ``max_lora_rank``: the engine's (vLLM's default 16); the adapter's ranks are checked against it
    here, the engine checks them against its own in :func:`setup_lora_refit`. ``timeout``: see
    :data:`LORA_TIMEOUT`. ``spec``: the recipe (``lora_to_vllm``). Other keywords: ``RefitTrainer``'s.
    """

    def __init__(self, config, lora_config, tensors, *, rank: int, tp: int, trainer_ranks, inference_ranks, store,
                 max_lora_rank: int = 16, fsdp: bool = False, group: str = "vllm-lora", adapter_name: str = "default",
                 timeout: float = LORA_TIMEOUT, **kwargs):
        given = _adapter_tensors(tensors, adapter_name)
        if not given or not all(isinstance(t, torch.Tensor) for t in given.values()):
            raise ValueError(f"LoraTrainer: tensors must be a peft model with LoRA parameters of adapter "
                             f"{adapter_name!r}, or a dict PEFT saved name -> tensor; got {type(tensors).__name__}"
                             f"{' without them' if isinstance(tensors, torch.nn.Module) else ''}")
        dtype = next(iter(given.values())).dtype
        self.spec = recipes.lora_to_vllm(_adapter_dict(lora_config), config, tp, trainer_ranks, inference_ranks,
                                         max_lora_rank=max_lora_rank, src_dtype=dtype, fsdp=fsdp)
        join_as_trainer(self, given, self.spec.src, rank=rank, world_size=len(trainer_ranks) + len(inference_ranks),
                        store=store, group=group, timeout=timeout, **kwargs)
        # The copied tensors (not views of the buffer now) and their version counters: torch bumps a
        # tensor's ``_version`` on every in-place write, and shares it with the parameter a detached
        # tensor came from, so an optimizer's step on that parameter shows here. Held (an adapter is
        # small) so that a dropped state dict cannot hide it.
        buffer = self.tensors
        self._copied = {n: (t, t._version) for n, t in given.items()
                        if n in buffer and t.data_ptr() != buffer[n].data_ptr()}

    def publish(self) -> int:
        """Publish the adapter's next version (see the class docstring for what is refused)."""
        written = sorted(n for n, (t, v) in self._copied.items() if t._version != v)
        if written:
            raise ValueError(f"LoraTrainer.publish: {written} were written after the trainer copied them into its "
                             f"buffer, and the buffer is what is published: pass the peft model (or its "
                             f"nn.Parameters) so that they are bound to the buffer, or train tr.tensors")
        return super().publish()


class _LoraSlot:
    """One worker's in-place refit of one adapter (see the module docstring)."""

    def __init__(self, worker, info: dict):
        # vLLM is imported only inside its workers: importing this module must not import vLLM
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = worker.model_runner.lora_manager._adapter_manager  # vLLM 0.32 / 0.33: LRUCacheLoRAModelManager
        lc = manager.lora_config
        self.tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        adapter = info["adapter"]
        spec = recipes.lora_to_vllm(adapter, worker.model_runner.model_config.hf_config, tp, info["trainer_ranks"],
                                    info["inference_ranks"], max_lora_rank=lc.max_lora_rank, dtype=lc.lora_dtype,
                                    src_dtype=SRC_DTYPES[info["src_dtype"]], fsdp=info["fsdp"],
                                    served_modules=lc.target_modules)
        # The group this slot joins, as any serving rank does (one replica; the pull runs in update_lora).
        place = serving_rank(ServingInit(store=info["store"], trainer_ranks=info["trainer_ranks"],
                                         inference_ranks=info["inference_ranks"], src_dtype=info["src_dtype"],
                                         group=info["group"], timeout=info["timeout"], prefetch=False),
                             spec, tp=tp, tp_rank=self.tp_rank)
        self.spec, self.lora_id, self.rank = spec, info["lora_id"], place.rank
        if self.lora_id in manager.list_adapters():
            raise ValueError(f"init_lora_refit: vLLM already holds an adapter with lora_id={self.lora_id}")
        helper = PEFTHelper.from_dict(adapter)
        helper.validate_legal(lc)
        # Registered once, through vLLM's own manager, with zero factors: vLLM builds its packed
        # layout and activates a slot; pinned (CPU cache and slot) so that it is never evicted and
        # never reloaded from a path (a LoRARequest with this id finds it registered).
        zeros = {n: torch.zeros(lay.shape, dtype=lc.lora_dtype) for n, lay in spec.src.items()}
        manager.add_adapter(LoRAModel.from_lora_tensors(self.lora_id, zeros, helper, device="cpu",
                                                        dtype=lc.lora_dtype))
        manager.pin_adapter(self.lora_id)
        slot = manager.lora_index_to_id.index(self.lora_id)
        self.views, problems = {}, []
        for name, layout in spec.dst.items():
            module, what, i = name.rsplit(".", 2)
            view = getattr(manager.modules[module], what)[int(i)][slot, 0] if module in manager.modules else None
            if view is None or tuple(view.shape) != tuple(layout.local_shape(self.rank)):
                problems.append(f"{name}: vLLM holds {None if view is None else tuple(view.shape)}, the recipe "
                                f"gives {tuple(layout.local_shape(self.rank))}")
            self.views[name] = view
        if problems:
            manager.remove_adapter(self.lora_id)
            raise ValueError(f"init_lora_refit (TP rank {self.tp_rank}): vLLM's LoRA slots do not match "
                             f"lora_to_vllm: " + "; ".join(problems))
        self.device = next(iter(self.views.values())).device
        self._sub, _ = place.join(device=self.device, mode="shadow")
        self.manager, self.applied = manager, 0

    def update(self, version: int, timeout: float | None) -> dict:
        """Pull ``version``, agree over the TP group, then write every slot view and scale ``lora_B``
        once. Never raises (vLLM's executor stops reading replies at the first failed rank): every
        rank returns its outcome and :func:`refit_lora` raises."""
        from vllm.distributed import get_tp_group  # vLLM only inside its workers (module docstring)

        t0 = time.perf_counter()
        error = None
        try:  # broad on purpose: every TP rank must reach the agreement below
            got = self._sub.pull(version, timeout)
        except Exception as exc:  # noqa: BLE001
            error, got = f"{type(exc).__name__}: {exc}", None
        t1 = time.perf_counter()
        outcomes = [None] * dist.get_world_size(get_tp_group().cpu_group)
        dist.all_gather_object(outcomes, (self.tp_rank, got, error), group=get_tp_group().cpu_group)
        bad = [f"TP rank {r}: {e}" for r, _, e in outcomes if e] or (
            [f"TP ranks pulled different versions {sorted({v for _, v, _ in outcomes})}"]
            if len({v for _, v, _ in outcomes}) > 1 else [])
        if bad:
            return {"ok": False, "error": "; ".join(bad), "serves": self.applied}
        bufs = self._sub.tensors
        with torch.no_grad():
            for name, view in self.views.items():
                view.copy_(bufs[name])
                scale = self.spec.scaling.get(name, 1.0)
                if scale != 1.0:  # vLLM's optimize(): lora_b *= scaling, in the LoRA dtype, after the cast
                    view.mul_(scale)
        self.applied = got
        return {"ok": True, "version": got, "pull_ms": (t1 - t0) * 1e3,
                "agree_apply_ms": (time.perf_counter() - t1) * 1e3, "bytes": self._sub.stats.bytes_per_refit}

    def close(self) -> None:
        self._sub.close()


class LoraWorkerExtension(WorkerExtension):
    """vLLM worker extension (``worker_extension_cls=LORA_WORKER_EXTENSION``) with the LoRA refit's
    worker methods, next to :class:`~tritonreshard.vllm.WorkerExtension`'s."""

    def init_lora_refit(self, info: dict) -> dict:
        if self.__dict__.get("trs_lora") is not None:
            return {"ok": False, "error": "init_lora_refit was already called (call shutdown_lora_refit first)"}
        try:  # broad on purpose: the outcome is returned, the driver raises (see the module docstring)
            self.__dict__["trs_lora"] = _LoraSlot(self, info)
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True}

    def update_lora(self, version: int, timeout: float | None = None) -> dict:
        slot = self.__dict__.get("trs_lora")
        if slot is None:
            return {"ok": False, "error": "update_lora before init_lora_refit", "serves": 0}
        return slot.update(version, timeout)

    def shutdown_lora_refit(self) -> None:
        slot = self.__dict__.pop("trs_lora", None)
        if slot is not None:
            slot.close()


def setup_lora_refit(llm, info: dict) -> None:
    """Driver: check the adapter (``info`` from :func:`lora_init_info`) against the engine's LoRA
    settings (``max_lora_rank``, its ``target_modules`` filter, TP size, model) with one
    ``ValueError`` naming every problem before any worker is asked, then register it on every
    worker and join the refit group. Raises ``RuntimeError`` naming the workers that failed."""
    config = llm.llm_engine.vllm_config
    lc = config.lora_config
    if lc is None:
        raise ValueError("setup_lora_refit: the engine has no LoRA: start it with enable_lora=True")
    recipes.lora_to_vllm(info["adapter"], config.model_config.hf_config, config.parallel_config.tensor_parallel_size,
                         info["trainer_ranks"], info["inference_ranks"], max_lora_rank=lc.max_lora_rank,
                         served_modules=lc.target_modules)
    failed = [o["error"] for o in llm.collective_rpc("init_lora_refit", kwargs={"info": info}) if not o["ok"]]
    if failed:
        llm.collective_rpc("shutdown_lora_refit")
        raise RuntimeError(f"tritonreshard setup_lora_refit failed: {failed[0]}")


def refit_lora(llm, version: int, timeout: float | None = None) -> list[dict]:
    """Driver: every worker pulls and installs adapter ``version`` (all TP ranks or none), then the
    prefix cache is reset (cached KV of the adapter was computed with the old factors; vLLM keys it
    by the adapter's name and path, which do not change). Returns each worker's stats; raises
    ``RuntimeError`` naming the failed ranks (the slots then still hold the previous version)."""
    outcomes = llm.collective_rpc("update_lora", kwargs={"version": version, "timeout": timeout})
    failed = [o for o in outcomes if not o["ok"]]
    if failed:
        raise RuntimeError(f"tritonreshard LoRA refit of version {version} failed: {failed[0]['error']}; "
                           f"the adapter keeps serving version {failed[0]['serves']}")
    llm.reset_prefix_cache()
    return outcomes
