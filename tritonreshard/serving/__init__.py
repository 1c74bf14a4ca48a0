"""What every serving engine shares: the seam between tritonreshard and an inference engine.

An engine implements :class:`ServingEngine` (:mod:`~.seam`: its rank's layout, its model check,
its TP agreement, its apply, its failure) and registers its recipes (:mod:`~.registry`); the rest
is here, the same for every engine:

* :mod:`~.seam`: :class:`ServingEngine`, generic over its init and update infos, with the join and
  the refit written once; :class:`RankLayout`, :class:`UpdateInfo`;
* :mod:`~.registry`: :func:`register_recipe`, :func:`recipe_for`: recipes by ``(engine, source)``;
* :mod:`~.schema`: :class:`ServingInit`, the one init-info schema (defaults and checks once), and
  :data:`SRC_DTYPES`;
* :mod:`~.trainer`: :class:`ServingTrainer`, the trainer side (an engine's trainer class sets
  ``ENGINE`` and ``GROUP``);
* :mod:`~.layout`: :func:`serving_rank` (a TP rank's global rank and group kind) and
  :meth:`ServingRank.join` (the one ``RefitInference`` of the serving side);
* :mod:`~.membership`: fixed or elastic replicas, chosen once (:func:`replicas_of`);
* :mod:`~.pull`: background, inline or direct pull, chosen once (:func:`pull_mode`);
* :mod:`~.session`: :func:`refit`, one refit (check, agree, obtain, agree, apply, stats).

docs/code-layout.md ("Adding a serving engine") lists the files. Importing this package imports no engine.
"""
from .layout import ServingRank, serving_rank
from .membership import ElasticReplicas, FixedReplicas, replicas_of
from .pull import BackgroundPull, DirectPull, InlinePull, pull_mode
from .registry import recipe_for, register_recipe, registered
from .schema import SRC_DTYPES, ServingInit, rank_problems, src_dtype_name, src_dtype_problems
from .seam import Joined, RankLayout, ServingEngine, UpdateInfo
from .session import any_failed, failure_text, outcome, refit
from .trainer import ServingTrainer, join_as_trainer

__all__ = ["ServingEngine", "RankLayout", "UpdateInfo", "Joined", "register_recipe", "recipe_for", "registered",
           "ServingInit", "SRC_DTYPES", "src_dtype_name", "rank_problems", "src_dtype_problems", "ServingTrainer",
           "join_as_trainer", "ServingRank", "serving_rank", "FixedReplicas", "ElasticReplicas", "replicas_of",
           "BackgroundPull", "DirectPull", "InlinePull", "pull_mode", "refit", "outcome", "failure_text", "any_failed"]
