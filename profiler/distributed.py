"""Sharding across ``accelerate launch`` processes and exact reduction of the sums.

Every accumulator of the profiler is a sum (float64 behaviour weights and query moments,
integer counts), so processes work on disjoint shards of the probes / calibration samples
(item ``i`` goes to process ``i % world_size``) and the main process obtains the totals by an
all-reduce of the float64 / int64 sums; per-probe rows are gathered and put back in probe
order.  Only the main process writes the artifact.

Without ``accelerate launch`` (or with one process) everything here is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shard(self, count: int) -> list[int]:
        """Indices of the items this process handles, in increasing order."""
        return list(range(self.rank, count, self.world_size))


def process_info() -> ProcessInfo:
    """This process's place in an ``accelerate launch`` job (rank 0 of 1 otherwise)."""
    from accelerate import PartialState

    state = PartialState()
    return ProcessInfo(int(state.process_index), int(state.num_processes), torch.device(state.device))


def _comm_device(info: ProcessInfo) -> torch.device:
    # gloo reduces CPU tensors; NCCL needs them on this process's GPU.
    import torch.distributed as dist

    return info.device if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(info: ProcessInfo, array: np.ndarray) -> np.ndarray:
    """Elementwise sum of ``array`` over all processes (float64 / int64 kept exactly as dtype)."""
    if not info.distributed:
        return array
    import torch.distributed as dist

    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(_comm_device(info))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().numpy()


def gather_objects(info: ProcessInfo, obj) -> list:
    """Every process's ``obj``, in rank order (on every process)."""
    if not info.distributed:
        return [obj]
    import torch.distributed as dist

    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def any_process(info: ProcessInfo, flag: bool) -> bool:
    """True on every process when ``flag`` is true on at least one (e.g. an interruption)."""
    if not info.distributed:
        return flag
    return bool(all_reduce_sum(info, np.array([int(flag)], dtype=np.int64))[0])


def barrier(info: ProcessInfo) -> None:
    if info.distributed:
        import torch.distributed as dist

        dist.barrier()
