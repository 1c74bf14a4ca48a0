"""Which recipe lays out a refit: a registry keyed by serving engine and source, filled by the engines.

An engine package registers, when it is imported, one builder per source kind it serves
(:func:`register_recipe`): ``"hf"`` (the trainers hold FSDP row shards of the HF parameters) and
``"megatron"`` (Megatron-Core ranks), or a kind of its own. Both sides of a group find their recipe
here, by ``(engine, init.source)`` (:func:`recipe_for`): the trainers for its source layouts, each
engine rank for its destination layouts and parts, so the two are built by the same code.

A builder is called as ``build(init, layout, **extra)``: ``init`` the group's
:class:`~.schema.ServingInit` (ranks, dtype, ``megatron``, ``trace``; an engine's subclass adds its
own fields), ``layout`` the asking rank's :class:`~.seam.RankLayout` (the served model's config,
TP size, dtype, quantization, expert parallelism), ``extra`` what the engine passes through to its
own builder. It returns a spec with ``src``, ``dst`` and ``parts`` (``quant`` optional): a
``trs.recipes.RecipeSpec``, LoRA's ``LoraSpec`` or an engine's own.
"""
from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_recipe", "recipe_for", "registered"]

_BUILDERS: dict[tuple[str, str], Callable] = {}


def register_recipe(engine: str, source: str, build: Callable) -> None:
    """Register ``build`` as the recipe of ``engine`` (its :attr:`RankLayout.engine
    <.seam.RankLayout.engine>`) when the trainers hold ``source``. Registering the same builder
    again is a no-op (a module imported twice); another builder for a taken key is a ``ValueError``."""
    key = (engine, source)
    if _BUILDERS.get(key, build) is not build:
        raise ValueError(f"register_recipe: {key} already has the recipe {_BUILDERS[key].__qualname__}")
    _BUILDERS[key] = build


def registered() -> list[tuple[str, str]]:
    """Every ``(engine, source)`` with a recipe, sorted."""
    return sorted(_BUILDERS)


def recipe_for(init, layout, **extra):
    """The recipe of ``layout.engine`` for the trainers of ``init`` (``init.source``): ``ValueError``
    naming the registered keys when there is none (the engine's package was not imported, or it
    does not serve that source)."""
    key = (layout.engine, init.source)
    if key not in _BUILDERS:
        raise ValueError(f"no recipe for engine {layout.engine!r} with {init.source!r} trainers: registered "
                         f"{registered()} (an engine registers its own with "
                         f"tritonreshard.serving.register_recipe when its package is imported)")
    return _BUILDERS[key](init, layout, **extra)
