"""The demo's run configuration: built once by :mod:`.cli` from the arguments, then every spawned
rank's argument (so it is frozen and picklable)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    steps: int
    trainers: int
    inference: int
    mode: str
    backend: str
    device: str
    dist_backend: str
    max_staleness: int
    prompts: int
    group: int
    lr: float
    seed: int
    timeout: float
    peer_timeout: float = 10.0
    fault: tuple[str, int] | None = None  # (kind, K) from --fault
    restart: bool = False                 # --restart: a failed trainer group restarts from its checkpoint
    checkpoint_dir: str = ""              # where trainers checkpoint every version they publish

    @property
    def world_size(self) -> int:
        return self.trainers + self.inference

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.trainers))

    @property
    def inference_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.trainers, self.world_size))

    @property
    def comm_backend(self) -> str:
        """The backend of the collectives the policy runs (:class:`.policy.Comm` stages CUDA tensors
        through the CPU under gloo)."""
        return "nccl" if "nccl" in self.dist_backend else "gloo"

    def role(self, rank: int) -> str:
        """``rank`` as the driver names it in messages."""
        if rank < self.trainers:
            return f"trainer {rank}"
        return f"inference, TP rank {rank - self.trainers}"
