"""LoRA adapters refitted in place into vLLM's LoRA slots: no adapter file, scaling once per version.

Everything goes through the serving seam (:mod:`tritonreshard.serving`): one init schema
(:class:`LoraInit`, a ``ServingInit`` with the adapter's fields), the recipe from the registry
(``("vllm-lora", "hf")``: ``trs.recipes.lora_to_vllm``) on both sides, and the adapter slot as a
:class:`~tritonreshard.serving.ServingEngine` whose apply writes vLLM's slot views. Trainer side:
:class:`LoraTrainer` (a :class:`~tritonreshard.serving.ServingTrainer` publishing the adapter's A/B
factors in PEFT's names). Worker side: :class:`LoraWorkerExtension` (vLLM's ``worker_extension_cls``),
whose ``init_lora_refit`` registers the adapter once with vLLM's own manager (zeros, pinned in its
slot, so vLLM never reloads it from a path) and whose ``update_lora`` is the seam's refit: pull the
version, agree over the TP group, then write every slot view in place and fold the scaling into
``lora_B`` once, as vLLM's loader does.
Driver: :func:`lora_init_info`, :func:`setup_lora_refit` (checks the adapter against the engine
before any worker is asked), :func:`refit_lora` (which also resets the prefix cache: vLLM keys cached
KV blocks by the adapter's name and path only). The worker methods never raise: vLLM 0.32's
executor stops reading replies at the first failed rank, so each returns its outcome and the
driver functions raise. Importing this module does not import vLLM.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from .. import recipes
from ..serving import (
    RankLayout,
    ServingEngine,
    ServingInit,
    ServingRank,
    ServingTrainer,
    UpdateInfo,
    failure_text,
    register_recipe,
    src_dtype_name,
)
from . import WorkerExtension

__all__ = ["LoraTrainer", "LoraWorkerExtension", "LoraInit", "LORA_WORKER_EXTENSION", "LORA_TIMEOUT",
           "lora_init_info", "setup_lora_refit", "refit_lora"]

LORA_WORKER_EXTENSION = f"{__name__}.LoraWorkerExtension"
#: The LoRA refit's key in the serving seam's recipe registry, and its group's default name.
ENGINE = "vllm-lora"


def _adapter_dict(lora_config) -> dict:
    """A ``peft.LoraConfig`` (or its dict) as plain JSON data (sets become sorted lists): it crosses
    vLLM's RPC and feeds vLLM's ``PEFTHelper``."""
    raw = lora_config if isinstance(lora_config, dict) else lora_config.to_dict()
    return json.loads(json.dumps(raw, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


#: The LoRA refit's default ``timeout`` (seconds; trainers and engine workers): the trainers meet the
#: workers only once the engine has started, which took 35-69 s on 2 shared CPU cores in issue 41's
#: runs (the general 60 s would expire first). A dead peer is still noticed by its heartbeat (``peer_timeout``, 10 s).
LORA_TIMEOUT = 300.0


@dataclass(frozen=True)
class LoraInit(ServingInit):
    """The LoRA refit's init info: the serving seam's :class:`~tritonreshard.serving.ServingInit`
    (the group, its checks, written once) plus the adapter (``adapter``: a ``peft.LoraConfig``'s
    plain dict), the ``LoRARequest`` name and id requests will use, and ``fsdp`` (the trainers hold
    ``Shard(0)`` rows of the factors instead of whole copies). Its defaults differ where a LoRA
    refit does: group ``"vllm-lora"``, ``timeout`` :data:`LORA_TIMEOUT`, the pull inside the refit
    (``prefetch=False``: an adapter is small), no ``verify`` (the slots are checked against the
    recipe view by view instead)."""

    GROUP = ENGINE

    timeout: float = LORA_TIMEOUT
    prefetch: bool = False
    verify: bool | str = False
    adapter: dict | None = None
    lora_name: str = ""
    lora_id: int = 0
    fsdp: bool = False

    def problems(self, normal: dict) -> list[str]:
        problems = super().problems(normal)
        if not isinstance(self.lora_name, str) or not self.lora_name:
            problems.append(f"lora_name={self.lora_name!r} must be a non-empty str")
        if isinstance(self.lora_id, bool) or not isinstance(self.lora_id, int) or self.lora_id < 1:
            problems.append(f"lora_id={self.lora_id!r} must be an int >= 1 (vLLM's LoRARequest)")
        if not isinstance(self.adapter, dict):
            problems.append(f"adapter must be a peft.LoraConfig's dict, got {type(self.adapter).__name__}")
        if not isinstance(self.fsdp, bool):
            problems.append(f"fsdp must be True or False, got fsdp={self.fsdp!r}")
        return problems


def lora_init_info(lora_config, *, lora_name: str, lora_id: int, store: str, trainer_ranks, inference_ranks,
                   **fields) -> dict:
    """The plain dict for ``collective_rpc("init_lora_refit", kwargs={"info": ...})`` and for
    :class:`LoraTrainer`: a :class:`LoraInit` of the adapter (``lora_config``: a
    ``peft.LoraConfig`` or its dict), the ``LoRARequest`` name and id requests will use, and the
    refit group (as :func:`tritonreshard.vllm.init_info`; ``fields``: ``src_dtype``, ``fsdp``,
    ``group``, ``timeout`` (:data:`LORA_TIMEOUT`), ...). One ``ValueError`` naming every problem."""
    return LoraInit(adapter=_adapter_dict(lora_config), lora_name=lora_name, lora_id=lora_id, store=store,
                    trainer_ranks=trainer_ranks, inference_ranks=inference_ranks, **fields).to_dict()


def _lora_recipe(init: LoraInit, layout: RankLayout, *, max_lora_rank: int = 16, served_modules=None):
    """The registry's builder of ``("vllm-lora", "hf")``: ``lora_to_vllm`` for both sides (the
    workers pass their engine's ``max_lora_rank`` and ``target_modules``, the trainers theirs)."""
    dtype = {} if layout.dtype is None else {"dtype": layout.dtype}
    return recipes.lora_to_vllm(init.adapter, layout.config, layout.tp, list(init.trainer_ranks),
                                list(init.inference_ranks), max_lora_rank=max_lora_rank, src_dtype=init.dtype,
                                fsdp=init.fsdp, served_modules=served_modules, **dtype)


register_recipe(ENGINE, "hf", _lora_recipe)


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


class LoraTrainer(ServingTrainer):
    """Trainer side: this rank's adapter, published to the vLLM workers' LoRA slots.

    ``info``: the same :func:`lora_init_info` dict the engine's workers get (the adapter, the
    group, ``fsdp``, ``timeout``): where the trainers and the workers meet, written once.
    ``tensors``: the ``peft`` model itself (its LoRA parameters of adapter ``adapter_name``), or
    ``{PEFT saved name: tensor}`` (the names ``peft.get_peft_model_state_dict`` gives; whole or,
    with ``fsdp=True`` in ``info``, this rank's ``Shard(0)`` rows). Every ``nn.Parameter`` (or
    ``requires_grad`` leaf) given is *bound*: re-pointed at the trainer's shared buffer
    (``param.data``), so that ``optimizer.step()`` on the model writes what ``publish()`` publishes,
    with no copy. Any other tensor is copied into the buffer once: train ``tensors`` then.
    ``publish()`` raises ``ValueError`` naming each given tensor that was written after that copy
    (e.g. the detached ``get_peft_model_state_dict`` tensors, whose parameters an optimizer stepped:
    those steps would never be published) or each bound parameter re-pointed elsewhere since.

    ``max_lora_rank``: the engine's (vLLM's default 16); the adapter's ranks are checked against it
    here, the engine checks them against its own in :func:`setup_lora_refit`. ``spec``: the recipe
    (``lora_to_vllm``, from the seam's registry as the workers' is).
    """

    ENGINE = ENGINE
    GROUP = ENGINE
    INIT = LoraInit

    def __init__(self, config, info: dict, tensors, *, rank: int, tp: int, max_lora_rank: int = 16,
                 adapter_name: str = "default"):
        given = _adapter_tensors(tensors, adapter_name)
        if not given or not all(isinstance(t, torch.Tensor) for t in given.values()):
            raise ValueError(f"LoraTrainer: tensors must be a peft model with LoRA parameters of adapter "
                             f"{adapter_name!r}, or a dict PEFT saved name -> tensor; got {type(tensors).__name__}"
                             f"{' without them' if isinstance(tensors, torch.nn.Module) else ''}")
        init = LoraInit.from_dict(info)
        self._max_lora_rank = max_lora_rank
        # The trainers' dtype is their tensors'; the init info names it for the workers: the same.
        dtype = next(iter(given.values())).dtype
        if src_dtype_name(dtype) != init.src_dtype:
            raise ValueError(f"LoraTrainer: the adapter's tensors are {dtype}, info has src_dtype={init.src_dtype!r}: "
                             f"pass lora_init_info(..., src_dtype={src_dtype_name(dtype)!r})")
        # The info was checked when it was made (LoraInit): the trainers and every TP rank meet once.
        world = len(init.trainer_ranks) + len(init.inference_ranks)
        self._build(init, config, given, rank=rank, tp=tp, world_size=world, **init.configs)
        # The copied tensors (not views of the buffer now) and their version counters: torch bumps a
        # tensor's ``_version`` on every in-place write, and shares it with the parameter a detached
        # tensor came from, so an optimizer's step on that parameter shows here. Held (an adapter is
        # small) so that a dropped state dict cannot hide it.
        buffer = self.tensors
        self._copied = {n: (t, t._version) for n, t in given.items()
                        if n in buffer and t.data_ptr() != buffer[n].data_ptr()}

    def _recipe_extra(self) -> dict:
        return {"max_lora_rank": self._max_lora_rank}

    def publish(self) -> int:
        """Publish the adapter's next version (see the class docstring for what is refused)."""
        written = sorted(n for n, (t, v) in self._copied.items() if t._version != v)
        if written:
            raise ValueError(f"LoraTrainer.publish: {written} were written after the trainer copied them into its "
                             f"buffer, and the buffer is what is published: pass the peft model (or its "
                             f"nn.Parameters) so that they are bound to the buffer, or train tr.tensors")
        return super().publish()


class _LoraSlot(ServingEngine[LoraInit, UpdateInfo]):
    """One worker's in-place refit of one adapter, a serving engine of the seam (see the module
    docstring): its layout is vLLM's LoRA slots, its check registers the adapter and finds every
    slot view, its apply writes the views and folds the scaling in, and its failure is returned,
    never raised (vLLM's executor stops reading replies at the first failed rank)."""

    init_info_cls = LoraInit

    def __init__(self, worker, info: dict):
        self.worker = worker
        self.manager = worker.model_runner.lora_manager._adapter_manager  # vLLM 0.32 / 0.33: LRUCacheLoRAModelManager
        self.applied, self.failure = 0, None
        init = LoraInit.from_dict(info)
        self.lora_id = init.lora_id
        lc = self.manager.lora_config
        self.join_group(init, max_lora_rank=lc.max_lora_rank, served_modules=lc.target_modules)
        self.start_pulling()

    def rank_layout(self, init: LoraInit) -> RankLayout:
        # vLLM is imported only inside its workers: importing this module must not import vLLM
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        runner = self.worker.model_runner
        self.tp_rank = get_tensor_model_parallel_rank()
        return RankLayout(engine=ENGINE, tp=get_tensor_model_parallel_world_size(), tp_rank=self.tp_rank,
                          device=torch.device(runner.device), config=runner.model_config.hf_config,
                          dtype=self.manager.lora_config.lora_dtype)

    def check(self, place: ServingRank) -> None:
        """Register the adapter once, through vLLM's own manager, with zero factors (vLLM builds its
        packed layout and activates a slot; pinned, so that it is never evicted and never reloaded
        from a path), then check every slot view against the recipe."""
        from vllm.lora.lora_model import LoRAModel  # vLLM only inside its workers (module docstring)
        from vllm.lora.peft_helper import PEFTHelper

        manager, lc, spec = self.manager, self.manager.lora_config, place.spec
        self.spec, self.rank = spec, place.rank
        if self.lora_id in manager.list_adapters():
            raise ValueError(f"init_lora_refit: vLLM already holds an adapter with lora_id={self.lora_id}")
        helper = PEFTHelper.from_dict(place.init.adapter)
        helper.validate_legal(lc)
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

    def agree(self, version, error) -> list:
        from ._agree import agree  # vLLM's TP group: imported inside its workers only

        return agree(self.rank, version, error)

    @torch.no_grad()
    def apply(self, bufs) -> dict:
        """Every slot view, then ``lora_B`` scaled once, as vLLM's loader does."""
        t0 = time.perf_counter()
        for name, view in self.views.items():
            view.copy_(bufs[name])
            scale = self.spec.scaling.get(name, 1.0)
            if scale != 1.0:  # vLLM's optimize(): lora_b *= scaling, in the LoRA dtype, after the cast
                view.mul_(scale)
        return {"copy_ms": (time.perf_counter() - t0) * 1e3, "post_ms": 0.0}

    def fail(self, outcomes, cause) -> None:
        self.failure = failure_text(outcomes)  # returned by update(); refit_lora raises on the driver

    def update(self, version: int, timeout: float | None) -> dict:
        """Pull ``version``, agree over the TP group, then apply (the seam's refit). Never raises:
        every rank returns its outcome and :func:`refit_lora` raises."""
        if version <= self.applied:  # the same on every rank: no agreement needed
            return {"ok": False, "error": f"update_lora version={version} must be newer than the serving "
                                          f"version {self.applied}", "serves": self.applied}
        self.failure = None
        stats = self.refit(UpdateInfo(version=version, timeout=timeout))
        if stats is None:
            return {"ok": False, "error": self.failure, "serves": self.applied}
        self.applied = stats["version"]
        return {"ok": True, "version": stats["version"], "pull_ms": stats["wait_ms"],
                "agree_apply_ms": stats["agree_ms"] + stats["apply_ms"], "bytes": stats["bytes"]}

    def close(self) -> None:
        self.leave_group()


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
