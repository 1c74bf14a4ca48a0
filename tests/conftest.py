"""One place decides what hardware a test needs.

``@pytest.mark.cuda`` tests run only where ``torch.cuda.is_available()``; everywhere else (CI, the
developers' CPU machines) they are skipped with a reason instead of failing.
"""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_device():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (none on this machine)")
    return torch.device("cuda", 0)
