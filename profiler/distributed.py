"""Sharding across ``accelerate launch`` processes and exact reduction of the sums.

The process group, reduction, gathering and barriers are accelerate's (``PartialState``,
``accelerate.utils.reduce`` / ``gather_object``, ``wait_for_everyone``).  Sharding is
strided (:meth:`ProcessInfo.shard`) rather than accelerate's ``split_between_processes``,
which hands out contiguous blocks: probes come sorted by length, so blocks would give the
last process all the long ones.

Every accumulator of the profiler is a sum (float64 behaviour weights and query moments,
integer counts), so processes work on disjoint shards of the probes / calibration samples
(item ``i`` goes to process ``i % world_size``) and the main process obtains the totals by an
all-reduce of the float64 / int64 sums; per-probe rows are gathered and put back in probe
order.  Only the main process writes the artifact.

Without ``accelerate launch`` (or with one process) everything here is a no-op.

Launching on CPU.  ``accelerate launch --multi_gpu --num_processes N`` and ``torchrun
--nproc_per_node N`` start N workers through torch's elastic launcher; on a machine without
GPUs they run on CPU with the gloo backend.  ``accelerate launch --cpu --num_processes N``
(accelerate 1.x) starts a *single* process unless an MPI hostfile is given; it only exports
``ACCELERATE_USE_CPU`` and ``MASTER_ADDR``/``MASTER_PORT``.  :func:`requested_cpu_processes`
recognises that situation (reading N from the launcher's command line, its parent process) so
that the CLI can start the N gloo workers itself with torch's elastic launcher
(:func:`relaunch_with_torchrun`) instead of silently running one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

REDUCTION_TIMEOUT = timedelta(days=7)


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


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _launched_as_worker() -> bool:
    return any(os.environ.get(name) for name in ("WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


def requested_cpu_processes() -> int:
    """N when this process was started by ``accelerate launch --cpu --num_processes N`` (N > 1)
    as a single non-distributed process, else 0."""
    if not _env_flag("ACCELERATE_USE_CPU") or _launched_as_worker() or "MASTER_ADDR" not in os.environ:
        return 0
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = [part.decode(errors="replace") for part in fh.read().split(b"\0")]
    except OSError:
        return 0
    if not any("accelerate" in part for part in parent[:3]):
        return 0
    for index, part in enumerate(parent):
        for flag in ("--num_processes", "--num-processes"):
            if part == flag and index + 1 < len(parent):
                value = parent[index + 1]
            elif part.startswith(flag + "="):
                value = part.split("=", 1)[1]
            else:
                continue
            return int(value) if value.isdigit() and int(value) > 1 else 0
    return 0


def relaunch_with_torchrun(num_processes: int, module_args: list[str]) -> int:
    """Run ``python -m profiler.cli module_args`` as ``num_processes`` gloo workers; exit code."""
    from torch.distributed.run import get_args_parser, run

    port = os.environ.get("MASTER_PORT", "29500")
    args = get_args_parser().parse_args(
        [
            "--nproc_per_node",
            str(num_processes),
            "--nnodes",
            "1",
            "--master_addr",
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "--master_port",
            port,
            "--module",
            "profiler.cli",
            *module_args,
        ]
    )
    try:
        run(args)
    except Exception as exc:  # noqa: BLE001 - torchrun raises ChildFailedError with the details printed
        from common.log import logger

        logger("profiler").error(f"profile-model: a worker process failed: {type(exc).__name__}")
        return 1
    return 0


def process_info() -> ProcessInfo:
    """This process's place in an ``accelerate launch`` / ``torchrun`` job (rank 0 of 1 otherwise)."""
    from accelerate import PartialState

    cpu = _env_flag("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    # Processes meet only at the final reduction, where the fastest waits for the slowest
    # shard: far longer than the default 30-minute collective timeout on a big job.
    state = PartialState(cpu=cpu, timeout=REDUCTION_TIMEOUT)
    return ProcessInfo(int(state.process_index), int(state.num_processes), torch.device(state.device))


def _comm_device(info: ProcessInfo) -> torch.device:
    # gloo reduces CPU tensors; NCCL needs them on this process's GPU.
    import torch.distributed as dist

    return info.device if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(info: ProcessInfo, arrays):
    """Elementwise sum over all processes of an array or a dict of arrays (float64 / int64 kept
    exactly as dtype), with accelerate's ``reduce``."""
    if not info.distributed:
        return arrays
    from accelerate.utils import reduce

    single = isinstance(arrays, np.ndarray)
    tensors = {
        name: torch.from_numpy(np.ascontiguousarray(value)).to(_comm_device(info))
        for name, value in ({"": arrays} if single else arrays).items()
    }
    summed = {name: tensor.cpu().numpy() for name, tensor in reduce(tensors, reduction="sum").items()}
    return summed[""] if single else summed


def gather_objects(info: ProcessInfo, obj) -> list:
    """Every process's ``obj``, in rank order (on every process), with accelerate's ``gather_object``."""
    if not info.distributed:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def barrier(info: ProcessInfo) -> None:
    """Wait for every process (accelerate's ``wait_for_everyone``)."""
    if info.distributed:
        from accelerate import PartialState

        PartialState().wait_for_everyone()
