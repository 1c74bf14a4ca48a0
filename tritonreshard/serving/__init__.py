"""What every serving engine shares: the seam between tritonreshard and an inference engine.

An engine package (``tritonreshard.vllm``; a test's plain torch module, ``tests/_tp_engine.py``)
writes only what is its own (its TP agreement, its model check, its apply) and uses these:

* :mod:`~.schema`: :class:`ServingInit`, the one init-info schema (defaults and checks once), and
  :data:`SRC_DTYPES`;
* :mod:`~.trainer`: :class:`ServingTrainer`, the trainer side (:func:`join_as_trainer` for a trainer
  class of an engine's own, e.g. LoRA's);
* :mod:`~.layout`: :func:`serving_rank` (a TP rank's global rank, group kind and recipe) and
  :meth:`ServingRank.join` (the one ``RefitInference`` of the serving side); :func:`recipe_spec`;
* :mod:`~.membership`: fixed or elastic, chosen once (:func:`membership`);
* :mod:`~.pull`: background or inline pull, chosen once (:func:`pull_mode`);
* :mod:`~.session`: :func:`refit`, one refit (check, agree, obtain, agree, apply, stats).

docs/code-layout.md ("Adding an engine") lists the files. Importing this package imports no engine.
"""
from .layout import ServingRank, recipe_spec, serving_rank
from .membership import ElasticGroup, FixedGroup, membership
from .pull import BackgroundPull, InlinePull, pull_mode
from .schema import SRC_DTYPES, ServingInit, rank_problems, src_dtype_name, src_dtype_problems
from .session import any_failed, failure_text, outcome, refit
from .trainer import ServingTrainer, join_as_trainer

__all__ = ["ServingInit", "SRC_DTYPES", "src_dtype_name", "rank_problems", "src_dtype_problems", "ServingTrainer", "join_as_trainer",
           "ServingRank", "serving_rank", "recipe_spec", "FixedGroup", "ElasticGroup", "membership",
           "BackgroundPull", "InlinePull", "pull_mode", "refit", "outcome", "failure_text", "any_failed"]
