"""Recipes traced from vLLM's own loader, for a model type no hand-written recipe covers: :func:`trace_recipe`.

Each TP rank's vLLM model is built in this process, on the meta device (no weights allocated),
one rank at a time: vLLM's TP group is told it is rank ``t`` of ``tp`` while the model class is
constructed and loaded (nothing communicates then). The trainer's tensors (the HF model's
parameter names and shapes, from ``transformers`` on the meta device) are fed as meta tensors
through the rank's ``load_weights`` into meta scratch parameters, every copy recorded as a box
(:func:`._verify.trace_load`, :class:`~tritonreshard.recipes.metatrace.LoadTracer`), and the
boxes are compressed into a recipe (:func:`tritonreshard.recipes.trace.spec_from_trace`): a
loader that combines or transforms values is refused by name. Cost: the number of tensors, never
their sizes. :func:`vllm_load` is the per-rank load of real tensors (what vLLM itself holds),
which tests compare the traced refit with.

Imports vLLM (and ``transformers``): a process that traces must have both.
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile

import torch
from torch.overrides import TorchFunctionMode
from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
from vllm.model_executor.models.registry import ModelRegistry

from ..layout import Layout, Replicate, Shard
from ..recipes import RECIPES
from ..recipes.boxes import first_difference, recipe_pieces, where
from ..recipes.builder import check_tp, raise_problems, rank_list
from ..recipes.trace import checkpoint_views, layer_groups, layer_of, spec_from_trace
from ..serving import SRC_DTYPES
from ._cost import Cost
from ._verify import scratch_load, trace_load

__all__ = ["trace_recipe", "vllm_load", "hf_sources", "rank_models", "recipe_differences"]


def hf_sources(config, trainer_ranks, src_dtype: torch.dtype = SRC_DTYPES["float32"]) -> dict[str, Layout]:
    """The trainers' tensors of an HF model of ``config``: its parameters (FSDP rows, ``Shard(0)``
    over ``trainer_ranks``, ``src_dtype``), and the router's ``e_score_correction_bias`` buffers that
    training changes (whole on every trainer, float32), as the hand-written recipes take them."""
    # Lazy: only the trace needs transformers; importing this module must not pull it in everywhere.
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    src = {n: Layout(tuple(p.shape), list(trainer_ranks), [Shard(0)], src_dtype) for n, p in model.named_parameters()}
    src |= {n: Layout(tuple(b.shape), list(trainer_ranks), [Replicate()], SRC_DTYPES["float32"])
            for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    return src


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_config(model_dir: str, dtype: torch.dtype) -> ModelConfig:
    return ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype=dtype,
                       enforce_eager=True)


def _world() -> None:
    """vLLM's distributed state for one process (gloo, world 1), once per process (with no model
    config, so that vLLM also makes the expert-parallel group MoE layers read)."""
    if parallel_state.model_parallel_is_initialized():
        return
    # A distinct identifier keeps vLLM off its CPU shared-memory communicator (nothing in /dev/shm);
    # read while the groups are made, then put back: a vLLM server this process starts later must
    # not inherit it.
    before = os.environ.get("VLLM_DIST_IDENT")
    os.environ.setdefault("VLLM_DIST_IDENT", f"trs-trace-{os.getpid()}")
    try:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1)
    finally:
        if before is None:
            os.environ.pop("VLLM_DIST_IDENT", None)


@contextlib.contextmanager
def _as_tp_rank(tp: int, rank: int):
    """vLLM's TP (and expert-parallel) group says it is rank ``rank`` of ``tp`` while a model is
    built or loaded: in a process of one, or in a worker of a TP-``tp`` engine (``init_info(trace=True)``),
    where only the rank is changed, for the moments nothing else runs (nothing communicates while
    a model is built or loaded, and the worker's own calls wait for this one)."""
    # vLLM makes the expert-parallel group for MoE models only, and get_ep_group() asserts where
    # there is none (a dense engine's worker): read the module's group itself.
    groups = [parallel_state.get_tp_group(), *filter(None, [getattr(parallel_state, "_EP", None)])]
    if any(g.world_size not in (1, tp) for g in groups):
        raise RuntimeError(f"tritonreshard trace: this process's vLLM TP group has {groups[0].world_size} ranks; "
                           f"tracing builds every rank of TP {tp} in a process of one or in a worker of a TP-{tp} "
                           f"engine")
    old = [(g.world_size, g.rank_in_group) for g in groups]
    for g in groups:
        g.world_size, g.rank_in_group = tp, rank
    try:
        yield
    finally:
        for g, (size, r) in zip(groups, old, strict=True):
            g.world_size, g.rank_in_group = size, r


def _config_problems(config, tp) -> list[str]:
    problems = []
    archs = list(getattr(config, "architectures", None) or [])
    known = ModelRegistry.get_supported_archs()
    if not archs:
        problems.append("config.architectures is not set (vLLM picks the model class by it)")
    elif not any(a in known for a in archs):
        causal = sorted(a for a in known if a.endswith("ForCausalLM"))
        problems.append(f"config.architectures={archs}: vLLM serves none of them; hand-written recipes: "
                        f"{sorted(RECIPES)}; vLLM's {len(causal)} causal LMs: {causal}")
    check_tp(tp, problems)
    return problems


class _IndexTensorsOnCpu(TorchFunctionMode):
    """While a model is built on the meta device: integer tensors (vLLM's expert map under EP, index
    tables) are made on the CPU, so that a loader can read them; weights stay on the meta device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dtype = kwargs.get("dtype")
        if dtype is not None and not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters are made in ``dtype`` unless a layer says otherwise, as vLLM's loader builds a
    model (its ``set_default_torch_dtype``)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def rank_models(config, tp: int, *, dtype: torch.dtype = SRC_DTYPES["bfloat16"], expert_parallel: bool = False,
                device: str | None = None, ranks=None) -> list:
    """vLLM's model of ``config`` for each TP rank ``0 .. tp-1`` (or those of ``ranks``), built in
    this process on ``device``: by default the meta device, no weight allocated, integer tables
    (vLLM's expert map under EP) on the CPU."""
    raise_problems("tritonreshard trace", _config_problems(config, tp))
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        _world()
        models = []
        for r in range(tp) if ranks is None else ranks:
            # A VllmConfig per rank: vLLM registers every attention layer by name in it, once.
            mc = _model_config(model_dir, dtype)
            vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(
                tensor_parallel_size=tp, enable_expert_parallel=expert_parallel))
            on_meta = device in (None, "meta")
            with _as_tp_rank(tp, r), set_current_vllm_config(vc), torch.device(device or "meta"), \
                    (_IndexTensorsOnCpu() if on_meta else contextlib.nullcontext()), _default_dtype(dtype):
                cls, _ = ModelRegistry.resolve_model_cls(list(config.architectures), mc)
                models.append(cls(vllm_config=vc, prefix=""))
    return models


def vllm_load(models: list, tensors: dict[str, torch.Tensor],
              model_type: str | None = None) -> list[dict[str, torch.Tensor]]:
    """What each rank's vLLM ``load_weights`` makes of the full ``tensors`` (HF names): ``[{vLLM
    parameter: float64 tensor}]`` per TP rank (:data:`~tritonreshard.recipes.trace.POISON` where
    nothing landed). Fused experts are fed one expert at a time, as checkpoints hold them (named
    as ``model_type``'s checkpoints name them: :func:`~tritonreshard.recipes.trace.checkpoint_views`)."""
    feed = [pair for n, t in tensors.items() for pair in checkpoint_views(n, t, model_type)]
    out = []
    for r, model in enumerate(models):
        names = [n for n, _ in model.named_parameters()]
        with _as_tp_rank(len(models), r):
            # vLLM's loaders report a name they do not know as a KeyError (a parameters dict) or a
            # ValueError (AutoWeightsLoader): then every such name is found and named at once.
            try:
                out.append(scratch_load(model, _fresh(feed), names))
            except (KeyError, ValueError):
                metas = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}
                _refuse_names(model, metas, names, model_type)
                raise
    return out


def _fresh(feed):
    """``feed`` with each tensor copied as the loader takes it: a loader may write what it reads
    (gpt-oss's zeroes ``down_proj_bias`` in place on TP ranks > 0), which must reach neither the
    next rank nor the caller's tensors (a process's ranks read one checkpoint, each its own)."""
    return ((n, t.clone()) for n, t in feed)


def _refuse_names(model, metas, names, model_type) -> None:
    """One ``ValueError`` naming every tensor of ``metas`` vLLM's loader refuses (a name it has no
    parameter for), each traced alone."""
    refused = []
    for name, t in metas.items():
        try:  # as above: KeyError / ValueError is a name vLLM does not know
            trace_load(model, {name: t}, names, model_type)
        except (KeyError, ValueError) as exc:
            refused.append(f"{name} ({type(exc).__name__}: {str(exc)[:120]})")
    if refused:
        raise ValueError(f"tritonreshard trace: vLLM's {type(model).__name__}.load_weights refuses {len(refused)} "
                         f"tensor(s), their names do not match its parameters: {refused}; it has {names[:8]} ...")


def trace_recipe(config, *, tp: int, trainer_ranks, inference_ranks, dtype: torch.dtype = SRC_DTYPES["bfloat16"],
                 src_dtype: torch.dtype = SRC_DTYPES["float32"], expert_parallel: bool = False,
                 stats: dict | None = None):
    """The recipe of ``config`` (a ``transformers`` config vLLM serves) traced from vLLM's own
    loader on every TP rank: a :class:`~tritonreshard.recipes.RecipeSpec` of the same form as
    ``trs.recipes.hf_to_vllm``'s (sources: the HF parameters as FSDP rows over ``trainer_ranks`` in
    ``src_dtype``; destinations: vLLM's parameters over ``inference_ranks``, ``k * tp`` ranks of
    ``k`` replicas, in ``dtype``). The loaders run on meta tensors (no element is allocated or
    read: :class:`~tritonreshard.recipes.metatrace.LoadTracer`), one TP rank's model at a time.
    ``stats`` (a dict) receives the measured cost: ``trace_ms``, ``trace_cpu_ms``,
    ``trace_peak_bytes``, ``trace_held_bytes`` (:class:`._cost.Cost`) and ``hand_written``.

    Raises one ``ValueError`` naming every problem: bad ``tp`` or ranks, a config vLLM does not serve,
    a loader that is not a copy (by parameter), vLLM parameters no HF tensor reached, HF tensors
    vLLM's loader left out."""
    problems = _config_problems(config, tp)
    src_ranks = rank_list(trainer_ranks, "trainer_ranks", problems)
    dst_ranks = rank_list(inference_ranks, "inference_ranks", problems)
    if tp and dst_ranks and isinstance(tp, int) and len(dst_ranks) % tp:
        problems.append(f"inference_ranks has {len(dst_ranks)} ranks, not a multiple of tp={tp}")
    raise_problems(f"tritonreshard trace of {getattr(config, 'model_type', None)!r}", problems)
    with Cost() as cost:
        sources = hf_sources(config, src_ranks, src_dtype)
        traced, dtypes, order, group = [], {}, [], None
        for r in range(tp):  # one rank's model at a time: the memory is one rank's metadata
            (model,) = rank_models(config, tp, dtype=dtype, expert_parallel=expert_parallel, ranks=[r])
            if group is None:  # the layers' structures, from rank 0: one layer of each is traced
                order = [n for n, _ in model.named_parameters()]
                dtypes = {n: p.dtype for n, p in model.named_parameters()}
                group = layer_groups({n: tuple(p.shape) for n, p in model.named_parameters()}, sources)
                names = [n for n in order if layer_of(n) is None or layer_of(n) in group.traced]
                metas = {n: torch.empty(lay.shape, dtype=lay.dtype, device="meta") for n, lay in sources.items()
                         if layer_of(n) is None or layer_of(n) in group.traced}
            with _as_tp_rank(tp, r):
                traced.append(_traced_load(model, metas, names, config.model_type))
            del model
        part = spec_from_trace(config.model_type, {n: sources[n] for n in metas}, traced, tp=tp,
                               inference_ranks=dst_ranks, dtypes=dtypes, expert_parallel=expert_parallel)
        spec = group.extend(part, sources, order)
        del traced, metas
    if stats is not None:
        stats.update(cost.stats("trace"))
        stats["trace_layers"] = sorted(group.traced)
        stats["hand_written"] = config.model_type in RECIPES
    return spec


def _traced_load(model, metas, names, model_type):
    """:func:`._verify.trace_load` of ``metas``; vLLM's loaders report a name they do not know as a
    KeyError (a parameters dict) or a ValueError (AutoWeightsLoader): then every such name is found
    and named at once, each tried alone."""
    try:
        return trace_load(model, metas, names, model_type)
    except (KeyError, ValueError):
        _refuse_names(model, metas, names, model_type)
        raise


def recipe_differences(a, b, *, limit: int = 20) -> list[str]:
    """How recipes ``a`` and ``b`` differ in effect (empty: none): the source layouts, the
    destinations' names, dtypes and local shapes on every rank, then every element of every
    destination on every rank, as the boxes each recipe's own plan writes there (compared element
    for element, :func:`~tritonreshard.recipes.boxes.first_difference`)."""
    out: list[str] = []
    if a.src != b.src:
        diff = sorted(set(a.src) ^ set(b.src)) or sorted(n for n in a.src if a.src[n] != b.src[n])
        out.append(f"sources differ: {diff[:limit]}")
    if set(a.dst) != set(b.dst):
        out.append(f"destinations differ: {sorted(set(a.dst) ^ set(b.dst))[:limit]}")
    if out:
        return out
    ranks = sorted({r for lay in a.dst.values() for r in lay.ranks})
    out += [f"{n}: dtype or local shapes differ ({a.dst[n]!r} vs {b.dst[n]!r})" for n in a.dst
            if a.dst[n].dtype != b.dst[n].dtype or any(a.dst[n].local_shape(r) != b.dst[n].local_shape(r)
                                                       for r in ranks)]
    if out:
        return out[:limit]
    order = list(a.src)
    shapes = [tuple(a.src[n].shape) for n in order]
    out = []
    for r in ranks:
        pa, pb = recipe_pieces(a, r, order=order), recipe_pieces(b, r, order=order)
        for n in a.dst:
            if n in pa and n in pb and (diff := first_difference(pa[n], pb[n])) is not None:
                x, count, ga, gb = diff
                out.append(f"rank {r}: {n} holds other elements ({count} differ; at {list(x)}: "
                           f"{where(ga, x, order, shapes)} vs {where(gb, x, order, shapes)})")
    return out[:limit]
