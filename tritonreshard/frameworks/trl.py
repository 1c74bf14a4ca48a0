"""TRL's ``VLLMClient`` with its weight sync through tritonreshard (TRL 1.16).

TRL's own client (``trl.generation.vllm_client.VLLMClient``) syncs weights over vLLM's NCCL
weight-transfer engine: it raises on a device that is not CUDA, and ``trl vllm-serve`` starts the
server with ``--weight-transfer-config '{"backend": "nccl"}'``. :class:`VLLMClient` here is the same
class (generation, chat, logprobs are TRL's, unchanged) whose weight-sync methods refit the server
through tritonreshard instead: the client process is the refit group's one trainer rank, it hosts
the group's store at ``group_port``, and the server's TP workers pull each version straight out of
its shared buffer into their own TP shards of vLLM's parameters (no NCCL, CPU or CUDA).

The server: ``vllm serve`` with tritonreshard's backend and worker extension (and vLLM's RL routes)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "tritonreshard"}' \\
        --worker-extension-cls tritonreshard.vllm.WorkerExtension

The trainer script, one line before the trainer is built (GRPO in server mode, or any TRL trainer
that makes its client through ``trl.generation.vllm_generation``)::

    tritonreshard.frameworks.trl.install()

The weight-sync methods keep TRL's signatures (``init_communicator``, ``update_named_param``,
``update_named_params``, ``update_model_params``, ``weight_update``, ``reset_prefix_cache``,
``close_communicator``). What differs, and why:

* ``init_communicator`` checks the server once and names every setting it cannot serve in one
  ``ValueError`` (backend, worker extension, data or pipeline parallelism, the model's type),
  before anything joins.
* ``update_named_params`` writes the tensors into the trainer's shared buffer as TRL's iterator
  gathers them (one copy each, cast to the server's dtype as vLLM's own loader would), then
  publishes one version and has the server install it (``/update_weights`` with its version). Names,
  shapes and dtypes are checked against the model's recipe before any tensor is read; the first
  update must name every parameter (the buffer starts as zeros: a parameter never sent would be
  served as zeros). An update that fails part way leaves the server serving its last complete
  version, and the next update must again name every parameter.
"""
from __future__ import annotations

import atexit
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import torch
import trl.generation.vllm_client as trl_client
import trl.generation.vllm_generation as trl_generation

from .. import Timeouts, recipes
from ..serving import SRC_DTYPES
from ..vllm import BACKEND, WORKER_EXTENSION, Trainer, init_info

__all__ = ["VLLMClient", "install", "GROUP"]

#: The refit group's name on the server.
GROUP = "trl"


def install() -> type:
    """Make TRL's trainers build :class:`VLLMClient` (``trl.generation.vllm_generation``'s name for
    the client class, which GRPO's server mode constructs). Returns TRL's class it replaced."""
    previous = trl_generation.VLLMClient
    trl_generation.VLLMClient = VLLMClient
    return previous


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class VLLMClient(trl_client.VLLMClient):
    """TRL's ``VLLMClient`` (same constructor and generation methods), refitting through tritonreshard.

    Extra keywords: ``hf_config`` (the served model's ``transformers`` config; default: read from the
    model path the server reports, which must then be readable here), ``store_host`` (the address the
    server's workers reach this process at; default: the local address of the route to the server),
    ``timeout`` / ``peer_timeout`` (seconds: the refit group's, as ``tritonreshard.vllm.init_info``'s).
    """

    def __init__(self, base_url: str | None = None, host: str = "0.0.0.0", server_port: int = 8000,
                 group_port: int = 51216, connection_timeout: float = 0.0, *, hf_config=None,
                 store_host: str | None = None, timeout: float = 120.0, peer_timeout: float = 10.0):
        self.trainer = None
        self.hf_config, self.store_host = hf_config, store_host
        self.timeout, self.peer_timeout = float(timeout), float(peer_timeout)
        self._complete = False   # the buffer holds a whole model (every parameter was written)
        self._in_update = False  # inside weight_update(): start and finish are the context's
        super().__init__(base_url=base_url, host=host, server_port=server_port, group_port=group_port,
                         connection_timeout=connection_timeout)

    # -- set-up -------------------------------------------------------------------------------

    def _served(self) -> dict:
        """What the server serves: ``{tp, dtype, config, problems}`` from its ``/server_info``."""
        info = self.get_server_info()
        problems = []
        transfer = info.get("weight_transfer_config") or {}
        if transfer.get("backend") != BACKEND:
            problems.append(f"the server's weight-transfer backend is {transfer.get('backend')!r}; start it with "
                            f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}'")
        parallel = info.get("parallel_config") or {}
        extension = parallel.get("worker_extension_cls") or ""
        if extension != WORKER_EXTENSION:
            problems.append(f"the server's worker extension is {extension!r}; start it with "
                            f"--worker-extension-cls {WORKER_EXTENSION}")
        for key, flag in (("data_parallel_size", "--data-parallel-size"),
                          ("pipeline_parallel_size", "--pipeline-parallel-size")):
            if int(parallel.get(key, 1)) != 1:
                problems.append(f"{key}={parallel.get(key)} (the server's {flag}): one trainer process refits one "
                                f"tensor-parallel engine")
        model = info.get("model_config") or {}
        dtype = SRC_DTYPES.get(str(model.get("dtype", "")).removeprefix("torch."))
        if dtype is None:
            problems.append(f"the server's dtype {model.get('dtype')!r} is not one of {list(SRC_DTYPES)}")
        config = self.hf_config
        if config is None:
            from transformers import AutoConfig  # lazy: only a client without hf_config reads one

            try:
                config = AutoConfig.from_pretrained(model.get("model"))
            except OSError as exc:
                problems.append(f"the served model's config could not be read from {model.get('model')!r} here "
                                f"({exc.__class__.__name__}); pass hf_config=")
        if config is not None and config.model_type not in recipes.RECIPES:
            problems.append(f"model_type {config.model_type!r} has no recipe (known: {sorted(recipes.RECIPES)})")
        return dict(tp=int(parallel.get("tensor_parallel_size", 1)), dtype=dtype, config=config, problems=problems)

    def _local_address(self) -> str:
        """The address of this host on the route to the server (what its workers connect back to)."""
        if self.store_host is not None:
            return self.store_host
        server = urlparse(self.base_url).hostname or "127.0.0.1"
        if server in ("localhost", "127.0.0.1", "0.0.0.0"):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((server, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]

    def init_communicator(self, device: torch.device | str | int = 0):
        """Join the server's workers as the refit group's trainer (rank 0, hosting the group's store
        at ``group_port``). The server is checked first: one ``ValueError`` naming every setting it
        cannot serve, before anything joins. ``device``: where this process keeps the weights it
        publishes (``"cpu"`` works, unlike TRL's NCCL client; an int is a CUDA device index)."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        served = self._served()
        problems = served["problems"]
        if device.type not in ("cpu", "cuda"):
            problems.append(f"device {device} is neither cpu nor cuda")
        if self.trainer is not None:
            problems.append("init_communicator was called already (close_communicator first)")
        if problems:
            raise ValueError(f"tritonreshard TRL client ({self.base_url}): " + "; ".join(problems))
        tp, dtype = served["tp"], served["dtype"]
        store = f"{self._local_address()}:{self.group_port}"
        trainers, readers = [0], list(range(1, 1 + tp))
        spec = recipes.hf_to_vllm(served["config"], tp=tp, trainer_ranks=trainers, inference_ranks=readers,
                                  src_dtype=dtype)
        zeros = {n: torch.zeros(lay.shape, dtype=dtype, device=device) for n, lay in spec.src.items()}
        info = init_info(store=store, trainer_ranks=trainers, inference_ranks=readers, src_dtype=_dtype_name(dtype),
                         group=GROUP, timeout=self.timeout, peer_timeout=self.peer_timeout)
        joined = {}

        def join():  # the server's workers meet this trainer inside its /init_weight_transfer_engine
            joined["trainer"] = Trainer(served["config"], zeros, rank=0, tp=tp, trainer_ranks=trainers,
                                        inference_ranks=readers, store=store, group=GROUP,
                                        timeouts=Timeouts(wait=self.timeout, peer=self.peer_timeout))

        thread = threading.Thread(target=join, name="trs-trl-join", daemon=True)
        thread.start()
        self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": info})
        thread.join(self.timeout)
        if "trainer" not in joined:
            raise RuntimeError(f"tritonreshard TRL client: the server's workers did not join the group at {store} "
                               f"within {self.timeout} s")
        self.trainer, self._complete = joined["trainer"], False
        self.world_size, self.version = 1 + tp, 0
        atexit.register(self.close_communicator)

    # -- weight sync ---------------------------------------------------------------------------

    @contextmanager
    def weight_update(self):
        """Several ``update_named_param(s)`` calls as one version: the buffer is written by each,
        and published and installed once, on exit."""
        self._start_weight_update()
        self._in_update = True
        try:
            yield
            self._publish_and_install()
        finally:
            self._in_update = False
            self._finish_weight_update()

    def update_named_param(self, name: str, weights: torch.Tensor):
        """One parameter (TRL's signature); outside :meth:`weight_update` a version of its own."""
        self.update_named_params([(name, _dtype_name(weights.dtype), list(weights.shape))], iter([(name, weights)]))

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, torch.Tensor]]):
        """Write ``named_params`` (HF names, full tensors, in ``metadata``'s order) into the trainer's
        buffer and publish them as one version, installed by the server before this returns.
        ``metadata``: ``(name, dtype name, shape)`` per tensor, TRL's form; checked whole first."""
        self._check(metadata)
        if not self._in_update:
            self._start_weight_update()
        try:
            self._write(metadata, named_params)
            if not self._in_update:
                self._publish_and_install()
        finally:
            if not self._in_update:
                self._finish_weight_update()

    def update_model_params(self, model: torch.nn.Module):
        """Every parameter of ``model`` (its ``named_parameters()`` names: a plain HF model's)."""
        metadata = [(n, _dtype_name(p.dtype), list(p.shape)) for n, p in model.named_parameters()]
        self.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))

    def _check(self, metadata) -> None:
        if self.trainer is None:
            raise RuntimeError("tritonreshard TRL client: call init_communicator() before updating weights")
        tensors, problems = self.trainer.tensors, []
        names = [m[0] for m in metadata]
        unknown = [n for n in names if n not in tensors]
        if unknown:
            problems.append(f"{len(unknown)} names the served model's recipe does not have: {unknown[:8]}")
        for name, dtype, shape in metadata:
            if name in tensors and tuple(shape) != tuple(tensors[name].shape):
                problems.append(f"{name}: shape {list(shape)}, the served model's is {list(tensors[name].shape)}")
            if dtype not in SRC_DTYPES:
                problems.append(f"{name}: dtype {dtype!r} is not one of {list(SRC_DTYPES)}")
        if len(set(names)) != len(names):
            problems.append(f"names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        if not self._complete:
            missing = sorted(set(tensors) - set(names))
            if missing:
                problems.append(f"the first update (or the first after a failed one) must name every parameter; "
                                f"{len(missing)} missing: {missing[:8]}")
        if problems:
            raise ValueError("tritonreshard TRL client: " + "; ".join(problems))

    def _write(self, metadata, named_params) -> None:
        """The tensors into the buffer, once the readers finished the last version (``fence``)."""
        self.trainer.fence()
        tensors = self.trainer.tensors
        self._complete = False  # until every tensor of this update is in: a failure leaves a mixed buffer
        stream = iter(named_params)
        for index, (name, _, _) in enumerate(metadata):
            got, value = next(stream, (None, None))
            if got != name or tuple(value.shape) != tuple(tensors[name].shape):
                shape = None if value is None else list(value.shape)
                raise ValueError(f"tritonreshard TRL client: tensor {index} is {got!r} of shape {shape}; metadata "
                                 f"announced {name!r} of {list(tensors[name].shape)} (nothing of this update is "
                                 f"served; the next must name every parameter)")
            tensors[name].copy_(value)
        if next(stream, None) is not None:
            raise ValueError(f"tritonreshard TRL client: the tensors go on past the {len(metadata)} metadata "
                             f"announced (nothing of this update is served; the next must name every parameter)")
        self._complete = True

    def _publish_and_install(self) -> None:
        if not self._complete:
            return  # a failed write: the server keeps serving its last complete version
        self.version = self.trainer.publish()
        self._post(f"{self.base_url}/update_weights", json={"update_info": {"version": self.version}})

    def _finish_weight_update(self):
        self._post(f"{self.base_url}/finish_weight_update", json={"weight_version": str(self.version)})

    def close_communicator(self):
        """Leave the refit group: the server's workers leave it (``/shutdown_weight_transfer_engine``)
        and keep serving the last installed version; this process's buffer and store are closed."""
        trainer, self.trainer = self.trainer, None
        if trainer is None:
            return
        atexit.unregister(self.close_communicator)
        try:
            self._post(f"{self.base_url}/shutdown_weight_transfer_engine", json={})
        finally:
            trainer.close()
