"""The applications built on tritonreshard: the ``tritonreshard`` command (:mod:`.cli`), the RL refit
demo (:mod:`.demo`, with its policy model), the benchmark (:mod:`.bench`), plan
pictures (:mod:`.viz`), the process driver the demo and the bench share (:mod:`.driver`), and the
helpers tests, examples and bench share (:mod:`.kit`: a free port, the process launcher, the tiny
model, greedy decoding).

The folder ``apps/`` imports as ``tritonreshard.apps``. It sits on top of the library: the library
(everything else under ``tritonreshard``) never imports it, so a user of the engine pulls in neither
matplotlib nor the demo's model.
"""
__all__: list[str] = []
