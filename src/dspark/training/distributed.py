"""Processes of a training run: torchrun's ranks, the process group, collective helpers, threads.

One process, or many under ``torchrun`` (DDP; gloo on CPU, nccl on GPU). Every helper
is a no-op (or the identity) in a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dspark.training.config import TrainConfig, TrainConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device) -> DistInfo:
    """Read torchrun's WORLD_SIZE / RANK / LOCAL_RANK and join the process group if there is one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    import torch.distributed as dist

    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return info


def barrier(d: DistInfo) -> None:
    if d.distributed:
        torch.distributed.barrier()


def all_mean(d: DistInfo, values: list[float]) -> list[float]:
    if not d.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(t)
    return (t / d.world_size).tolist()


def all_sum(d: DistInfo, value: float) -> float:
    if not d.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(t)
    return float(t.item())


def _collective_device() -> torch.device:
    """nccl reduces GPU tensors only; gloo host tensors."""
    return torch.device("cuda") if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainConfigError("device 'cuda' was asked for but no GPU is available; use device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def out_of_time(cfg: TrainConfig, d: DistInfo, seconds: float, session_seconds: float = 0.0) -> bool:
    """Past ``time_budget_s`` (training seconds across resumes) or ``session_time_s`` (this session's); all ranks
    agree (rank 0's clock decides), so every rank stops at the same step."""
    if cfg.time_budget_s is None and cfg.session_time_s is None:
        return False
    over = (cfg.time_budget_s is not None and seconds >= cfg.time_budget_s) or (
        cfg.session_time_s is not None and session_seconds >= cfg.session_time_s)
    flag = torch.tensor([1.0 if over else 0.0])
    if d.distributed:
        torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


def set_threads(cfg: TrainConfig, d: DistInfo, device: torch.device) -> None:
    """torch's intra-op threads: ``cfg.num_threads`` when set (``dspark --threads N train`` sets it, over the
    config's own value), else an equal share of the cores per local rank under torchrun on CPU."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    elif d.distributed and device.type == "cpu":  # do not oversubscribe the cores among local ranks
        local = int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
