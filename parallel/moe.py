"""The experts of a MoE layer, split over ranks, with their shard loading and collectives.

Two layouts, chosen when the layer is built from the groups in
fleet.parallel.comm:

- tensor parallel (expert parallel off, EP size 1): every rank holds every
  expert, a 1/TP slice of its intermediate dim (gate/up rows, down columns);
  the partial outputs are summed over the TP group.
- expert parallel (EP size > 1; EP = every DP x TP rank of the stage): rank r
  of the EP group holds experts [r * E/EP, (r + 1) * E/EP) whole. The TP ranks
  of a replica hold the same tokens, the DP replicas different ones, so the
  tokens of every replica are gathered over the DP group, every EP rank runs
  its experts on all of them, the outputs are summed over the EP group, and
  each rank keeps its replica's rows.
"""
from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fleet.kernels.moe import fused_moe, select_experts
from fleet.parallel.comm import get_dp_group, get_ep_group, get_tp_group
from fleet.parallel.layers import shape_of

Projection = Literal["gate", "up", "down"]


class ExpertShard(NamedTuple):
    """The shard id FusedMoE's weight loader takes: which expert, which projection."""

    expert: int
    projection: Projection


# HF per-expert projection name -> ours (Mixtral: w1/w3/w2; Qwen2-MoE, DeepSeek: gate_proj/up_proj/down_proj)
_HF_PROJECTIONS: dict[str, Projection] = {
    "w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
}
_HF_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def expert_param_name(hf_name: str) -> tuple[str, ExpertShard] | None:
    """For an HF per-expert weight (`<prefix>.experts.<e>.<w1|w2|w3|gate_proj|up_proj|down_proj>.weight`),
    FusedMoE's parameter name (`<prefix>.experts.w13` or `.w2`) and shard; None for any other name."""
    match = _HF_EXPERT.match(hf_name)
    if match is None or match["proj"] not in _HF_PROJECTIONS:
        return None
    projection = _HF_PROJECTIONS[match["proj"]]
    param = "w2" if projection == "down" else "w13"
    return f"{match['prefix']}.{param}", ExpertShard(int(match["expert"]), projection)


def check_experts_loaded(model: nn.Module) -> None:
    """Raise ValueError when a checkpoint left some expert of `model` unfilled:
    a load_weights that tracks whole parameters cannot see one missing expert."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.missing_shards():
            missing = module.missing_shards()
            raise ValueError(f"the checkpoint has no weights for {len(missing)} expert projections of {name}, "
                             f"e.g. {[tuple(shard) for shard in missing[:5]]}")


class ReplicatedLinear(nn.Module):
    """y = x W^T, W whole on every rank (a router: every rank routes alike)."""

    def __init__(self, input_size: int, output_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """This rank's experts as two stacked parameters, `w13` [E_local, 2 I_local, H]
    (gate rows, then up rows) and `w2` [E_local, H, I_local], and the
    collectives that turn their outputs into the layer's output.

    forward(hidden [T, H], router_logits [T, E]) -> [T, H], complete on every rank.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp, self.ep, self.dp = get_tp_group(), get_ep_group(), get_dp_group()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        if self.ep.size > 1:
            if num_experts % self.ep.size:
                raise ValueError(
                    f"--enable-expert-parallel: the model's {num_experts} experts must divide over the "
                    f"expert-parallel size {self.ep.size} (data-parallel x tensor-parallel)"
                )
            self.num_local_experts = num_experts // self.ep.size
            self.expert_offset = self.ep.rank * self.num_local_experts
            self.slice_rank, self.intermediate_per_rank = 0, intermediate_size
        else:
            if intermediate_size % self.tp.size:
                raise ValueError(f"the experts' intermediate size ({intermediate_size}) is not divisible by the "
                                 f"tensor parallel size ({self.tp.size}); consider --enable-expert-parallel")
            self.num_local_experts, self.expert_offset = num_experts, 0
            self.slice_rank, self.intermediate_per_rank = self.tp.rank, intermediate_size // self.tp.size
        local, inter = self.num_local_experts, self.intermediate_per_rank
        self.w13 = self._parameter((local, 2 * inter, hidden_size), dtype, device)
        self.w2 = self._parameter((local, hidden_size, inter), dtype, device)
        self.loaded_shards: set[ExpertShard] = set()
        """Local experts' projections loaded so far (see `missing_shards`)."""

    def _parameter(self, shape: tuple[int, ...], dtype: torch.dtype | None,
                   device: torch.device | str | None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: ExpertShard | None = None) -> None:
        """One HF expert projection (gate/up [I, H], down [H, I]) into its place;
        experts of other ranks are skipped, the intermediate dim is sliced."""
        if not isinstance(shard_id, ExpertShard):
            raise ValueError(f"FusedMoE loads one expert's projection at a time, got shard id {shard_id!r}")
        local = shard_id.expert - self.expert_offset
        if not 0 <= shard_id.expert < self.num_experts:
            raise ValueError(f"checkpoint expert {shard_id.expert} is outside the model's {self.num_experts} experts")
        if not 0 <= local < self.num_local_experts:
            return  # another expert-parallel rank's expert
        inter, start = self.intermediate_per_rank, self.slice_rank * self.intermediate_per_rank
        full = (self.hidden_size, self.intermediate_size) if shard_id.projection == "down" else (
            self.intermediate_size, self.hidden_size)
        if shape_of(loaded) != full:
            raise ValueError(f"expert {shard_id.expert} {shard_id.projection}: checkpoint tensor has shape "
                             f"{shape_of(loaded)}, expected {full}")
        if shard_id.projection == "down":
            param.data[local].copy_(loaded[:, start : start + inter])
        else:
            row = 0 if shard_id.projection == "gate" else inter
            param.data[local, row : row + inter].copy_(loaded[start : start + inter])
        self.loaded_shards.add(shard_id)

    def missing_shards(self) -> list[ExpertShard]:
        """This rank's expert projections that no checkpoint weight has filled."""
        experts = range(self.expert_offset, self.expert_offset + self.num_local_experts)
        wanted = [ExpertShard(e, p) for e in experts for p in ("gate", "up", "down")]
        return [shard for shard in wanted if shard not in self.loaded_shards]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] (the same on every TP rank) -> [T, H]."""
        if self.ep.size > 1:
            return self._forward_expert_parallel(hidden, router_logits)
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)  # [T, k]
        return self.tp.all_reduce(fused_moe(hidden, self.w13, self.w2, weights, ids))

    def _forward_expert_parallel(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Every rank runs the same collectives whatever its token count (0
        included): that keeps the replicas in lock-step.

            counts    all_gather(DP)  [DP]            every rank sees every replica's count
            tokens    all_gather(DP)  [DP * max, H+E]  hidden and logits, padded to the max
            outputs   all_reduce(EP)  [N, H]           N = sum(counts): padding dropped first
        """
        num_tokens = hidden.shape[0]
        count = torch.tensor([num_tokens], dtype=torch.int64, device=hidden.device)
        counts = self.dp.all_gather(count, dim=0).tolist()  # [DP]
        max_tokens = max(counts)
        if max_tokens == 0:
            return hidden  # [0, H]: every rank of every replica skips alike
        both = torch.cat([hidden, router_logits.to(hidden.dtype)], dim=-1)  # [T, H+E]
        padded = F.pad(both, (0, 0, 0, max_tokens - num_tokens))  # [max, H+E]
        gathered = self.dp.all_gather(padded, dim=0)  # [DP * max, H+E]
        if self.dp.size > 1:
            rows = torch.cat([torch.arange(d * max_tokens, d * max_tokens + n, device=hidden.device)
                              for d, n in enumerate(counts)])
            gathered = gathered[rows]  # [N, H+E]
        all_hidden, all_logits = gathered.split([self.hidden_size, self.num_experts], dim=-1)
        weights, ids = select_experts(all_logits, self.top_k, self.renormalize)  # [N, k]
        out = fused_moe(all_hidden, self.w13, self.w2, weights, ids, self.expert_offset)  # [N, H], this rank's experts
        out = self.ep.all_reduce(out)  # every expert's contribution
        start = sum(counts[: self.dp.rank])
        return out[start : start + num_tokens]
