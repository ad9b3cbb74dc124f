"""The collectives layers call, without knowing the backend.

A GroupCoordinator wraps one torch.distributed process group (gloo on CPU,
nccl on CUDA); with a single rank every collective returns its input and
torch.distributed is never touched. Process groups are created elsewhere
(parallel/groups.py); this module holds the current tensor-, pipeline-, expert- and
data-parallel ones.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GroupCoordinator:
    """This process's view of one parallel group: its rank, the size, the collectives."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        if size > 1 and group is None:
            raise ValueError(f"a group of {size=} needs a torch.distributed process group")
        if not 0 <= rank < size:
            raise ValueError(f"{rank=} is outside a group of {size=}")
        self.rank = rank
        self.size = size
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns the summed tensor. Every rank
        holds the same shape, so an empty tensor (a replica's token-less step)
        is skipped by all of them alike."""
        if self.size == 1 or tensor.numel() == 0:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor, concatenated along `dim` in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenation along `dim` on group rank `dst`; None on the other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        dist.gather(tensor, parts, dst=dist.get_global_rank(self.group, dst), group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None


    # ---- pipeline point-to-point ---------------------------------------------------------

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def send_next(self, tensor: torch.Tensor) -> None:
        """Send to the next rank of the group (the next pipeline stage); the
        receiver knows the shape, so an empty tensor is not sent at all."""
        if tensor.numel() == 0:
            return
        dist.send(tensor.contiguous(), dst=dist.get_global_rank(self.group, self.rank + 1), group=self.group)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive a tensor of known shape from the previous rank (stage)."""
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if tensor.numel() == 0:
            return tensor
        dist.recv(tensor, src=dist.get_global_rank(self.group, self.rank - 1), group=self.group)
        return tensor


_tp_group = GroupCoordinator()
_pp_group = GroupCoordinator()
_ep_group = GroupCoordinator()
_dp_group = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this worker (single-rank until set)."""
    return _tp_group


def set_tp_group(group: GroupCoordinator) -> None:
    global _tp_group
    _tp_group = group


def get_pp_group() -> GroupCoordinator:
    """The pipeline-parallel group of this worker: rank = its stage (single-stage until set)."""
    return _pp_group


def set_pp_group(group: GroupCoordinator) -> None:
    global _pp_group
    _pp_group = group


def get_ep_group() -> GroupCoordinator:
    """The expert-parallel group of this worker: every DP x TP rank of its
    pipeline stage (single-rank until set, and when expert parallel is off)."""
    return _ep_group


def set_ep_group(group: GroupCoordinator) -> None:
    global _ep_group
    _ep_group = group


def get_dp_group() -> GroupCoordinator:
    """The same (pipeline, tensor) position in every data-parallel replica;
    spans processes only when replicas step together (expert parallel)."""
    return _dp_group


def set_dp_group(group: GroupCoordinator) -> None:
    global _dp_group
    _dp_group = group
