"""The multi-process harness of the tests, re-exported from :mod:`tritonreshard.apps.kit` (where it is
defined, for tests, examples and bench alike) under the names twenty test files import."""
from tritonreshard.apps.kit import collect_ok, free_port, reap, run_ranks, start_rank

__all__ = ["collect_ok", "free_port", "reap", "run_ranks", "start_rank"]
