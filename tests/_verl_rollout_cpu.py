"""Stand-in: verl's platform for a CPU-only machine, for tests/_verl_rollout_run.py.

verl 0.9.1 registers the platforms ``nvidia``, ``huawei`` and ``amd`` only, and with none of them
present falls back to ``nvidia``: its ``BucketedWeightSender`` / ``BucketedWeightReceiver`` (the
ZMQ stream between a rollout GPU's ``CheckpointEngineWorker`` and its vLLM worker) then call
``torch.cuda.synchronize()``, which a CPU build of torch refuses. This module registers ``"cpu"``
(no IPC: verl takes its shared-memory path; synchronizing and emptying caches are no-ops). verl
imports it in every process that imports verl, the vLLM workers included, when the environment
names it: ``VERL_USE_EXTERNAL_MODULES=_verl_rollout_cpu`` and ``VERL_PLATFORM=cpu`` (verl's own
plugin variables), with tests/ on ``PYTHONPATH``.
"""
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _nothing(*args, **kwargs):
    return None


# What verl calls on the device module in its weight stream and workers; on a CPU there is nothing to wait for.
_CPU_MODULE = SimpleNamespace(synchronize=_nothing, empty_cache=_nothing, ipc_collect=_nothing,
                              current_device=lambda: 0, device_count=lambda: 1, is_available=lambda: True,
                              manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: one device, gloo, no IPC, no profiler."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPU_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
