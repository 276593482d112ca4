"""Every private torch name that lit_ddp relies on, in one place, each with what it relies on.

    pytest tests/test_private_apis.py      # fails loudly, naming the name, when the installed torch changed

Tested with torch 2.11, 2.13 and 2.14 (CI runs tests/test_private_apis.py on each). Reading profiler traces uses
none: ``lit_ddp.derive.trace`` reads the
Chrome-trace JSON that ``torch.profiler`` writes, a public format.
"""

import pickle
from typing import Any, Optional

import torch
import torch.cuda.memory
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import dataloader

from lit_ddp._lightning import PrivateName

PRIVATE_NAMES = [
    PrivateName(
        DistributedDataParallel,
        "_get_ddp_logging_data",
        "DDP's own record: its bucket sizes, unused parameters, find_unused_parameters",
    ),  # fmt: skip
    PrivateName(Optimizer, "_optimizer_step_post_hooks", "the tests check that PhaseTimer removes its step hook"),
    PrivateName(distributed_c10d, "_get_default_store", "the rendezvous store, to name hung ranks after a timeout"),
    PrivateName(distributed_c10d, "_get_default_group", "the default process group, for its timeout"),
    PrivateName(dist.ProcessGroup, "_get_backend", "see _get_default_group: its backend, whose options hold it"),
    PrivateName(torch._C._distributed_c10d, "_dump_fr_trace", "Flight Recorder's entries, read at a failure"),
    PrivateName(torch._C._distributed_c10d, "_dump_nccl_trace", "NCCL's Flight Recorder entries (CUDA builds)"),
    PrivateName(dataloader, "_MultiProcessingDataLoaderIter", "the watchdog names the worker a rank waits on"),
    PrivateName(
        dataloader._MultiProcessingDataLoaderIter,
        "_task_info",
        "see _MultiProcessingDataLoaderIter: the worker each batch index went to",
    ),
    PrivateName(
        dataloader._MultiProcessingDataLoaderIter,
        "_rcvd_idx",
        "see _MultiProcessingDataLoaderIter: the batch index the loader waits for",
    ),
    PrivateName(
        dataloader._MultiProcessingDataLoaderIter,
        "_workers",
        "see _MultiProcessingDataLoaderIter: the worker processes",
    ),
    PrivateName(torch.cuda.memory, "_record_memory_history", "PhaseTimer(memory_snapshot=True): allocation history"),
    PrivateName(torch.cuda.memory, "_dump_snapshot", "PhaseTimer(memory_snapshot=True): dumped on OOM"),
]
if not hasattr(dist.ProcessGroup, "all_gather_single"):  # its public name from torch 2.13 on
    PRIVATE_NAMES.append(
        PrivateName(
            dist.ProcessGroup, "_allgather_base", "StepSync's per-step gather, started without the Python layer"
        )
    )


def ddp_logging_data(model: Any) -> dict[str, Any]:
    """What DDP records about itself (``bucket_sizes``, ``rebuilt_bucket_sizes``, ``unused_parameter_size``,
    ``find_unused_parameters``, ...), or ``{}`` for a module that is not DDP."""
    get = getattr(model, "_get_ddp_logging_data", None)
    return dict(get()) if get is not None else {}


def record_memory_history(enabled: bool) -> None:
    """Starts (or stops) the CUDA caching allocator's record of every allocation and its stack, for a snapshot."""
    # The last 100,000 allocations and frees, as torch's memory docs suggest: unbounded, the record grows every step.
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)


def dump_memory_snapshot(path: str) -> None:
    """Writes the recorded history to ``path`` (a pickle that https://pytorch.org/memory_viz draws)."""
    torch.cuda.memory._dump_snapshot(path)


def optimizer_step_post_hooks(optimizer: Optimizer) -> dict:
    """The step post-hooks registered on ``optimizer`` (``register_step_post_hook``)."""
    return optimizer._optimizer_step_post_hooks


def cuda_driver_version() -> Optional[int]:
    """The CUDA version the driver supports (13000 for 13.0), for gpu_check's header; None without CUDA, and where
    torch no longer has the private call (gone in 2.14), so it is not among ``PRIVATE_NAMES``: nothing breaks."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    return get() if get is not None and torch.cuda.is_available() else None


def default_store() -> Optional[Any]:
    """The default process group's rendezvous store (a ``torch.distributed.Store``), None without one."""
    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def default_group_timeout_s() -> Optional[float]:
    """The default process group's timeout in seconds (its backend's options), None where it cannot be read."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return distributed_c10d._get_default_group()._get_backend(device).options._timeout.total_seconds()
    except Exception:  # no group, or a backend whose options hold none
        return None


def _dumped_entries(name: str) -> Optional[list[dict[str, Any]]]:
    dump = getattr(torch._C._distributed_c10d, name, None)
    if dump is None:
        return None
    try:  # torch's own pickle, of this process: the format its dumps on timeout and its analyzer use
        return pickle.loads(dump(True, True, False)).get("entries", [])
    except (RuntimeError, ValueError, pickle.UnpicklingError):
        return None


def flight_recorder_entries() -> list[dict[str, Any]]:
    """torch's Flight Recorder: this process's last collectives (``TORCH_FR_BUFFER_SIZE`` of them, on by default
    in torch 2.13 for gloo and NCCL), each a dict (``collective_seq_id``, ``profiling_name``, ``input_sizes``,
    ``input_dtypes``, ``time_created_ns``, ``state``, ``frames``: the Python stack that called it, ...), as torch
    dumps them on a timeout. A CUDA build keeps NCCL's collectives in NCCL's own recorder (``_dump_nccl_trace``,
    the same pickle): read where the backend is NCCL and ``_dump_fr_trace`` holds none. ``[]`` without either."""
    entries = _dumped_entries("_dump_fr_trace")
    if not entries and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        entries = _dumped_entries("_dump_nccl_trace")
    return entries or []


def loader_waits_for(loader: Any) -> Optional[tuple[int, int]]:
    """Where ``loader`` is a DataLoader's iterator over worker processes and waits for a batch a worker still
    holds: that worker's id and pid; None otherwise (no workers, or the batch is already there)."""
    if not isinstance(loader, dataloader._MultiProcessingDataLoaderIter):
        return None
    task = loader._task_info.get(loader._rcvd_idx, ())
    if len(task) != 1:  # (worker_id,) while the worker holds it; (worker_id, data) once it came back
        return None
    return task[0], loader._workers[task[0]].pid


def all_gather_started(output: Tensor, input: Tensor) -> dist.Work:
    """``dist.all_gather_single(output, input, async_op=True)`` on the default group, through the process group's
    own method: the Python layer above it (argument checks, torch-function dispatch, the coalescing check) was a
    third of the call, some 15-35 µs of a host-bound step (docs/performance.md). Flight Recorder records it the same
    way (it records in the process group). torch 2.11 and 2.12 name the method ``_allgather_base``."""
    group = dist.group.WORLD
    start = getattr(group, "all_gather_single", None) or group._allgather_base
    return start(output, input)
