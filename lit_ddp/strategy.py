"""Lightning's ``DDPStrategy`` with DDP's own knobs as typed, documented options.

    python -m lit_ddp.fit --trainer.strategy.static_graph true --trainer.strategy.bucket_cap_mb 1

``DDPStrategy`` forwards ``**kwargs`` to ``DistributedDataParallel``, which LightningCLI cannot turn into
options; this subclass names them, so they show in ``--help`` and YAML and are checked on parse.
"""

import ctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Literal, Optional

import torch
from jsonargparse.typing import PositiveFloat
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel


class LitDDPStrategy(DDPStrategy):
    """DDP with a short process-group timeout and DDP's bucket and graph options exposed.

    Args:
        timeout_s: Seconds a collective may wait before the process group aborts. Lightning's default
            is 30 minutes, so a hung rank stalls the job that long; a few-second experiment needs far less.
        static_graph: DDP's ``static_graph``: the graph is the same every step, which lets DDP skip
            the unused-parameter search and reorder buckets after the first step.
        gradient_as_bucket_view: Gradients are views into DDP's all-reduce buckets (saves a copy and memory).
        bucket_cap_mb: DDP's gradient bucket size in MiB (torch's default: 25). Smaller buckets start
            all-reducing earlier in backward, at the cost of more messages.
        find_unused_parameters: Search the graph for parameters without gradients every step.
        start_method: ``popen`` runs the script again for each rank (Lightning's ``ddp``); ``spawn``
            and ``fork`` start ranks with multiprocessing (``ddp_spawn``, ``ddp_fork``).
        process_group_backend: ``nccl`` or ``gloo``; ``None`` picks nccl on CUDA and gloo elsewhere.
        ddp_comm_hook: A DDP communication hook, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``; registered on
            CPU/gloo too. ``...debugging_hooks.noop_hook`` removes the gradient all-reduce (fault injection).
        ddp_comm_wrapper: Wraps ``ddp_comm_hook`` (or the plain all-reduce), e.g.
            ``...default_hooks.fp16_compress_wrapper``.
    """

    def __init__(
        self,
        timeout_s: PositiveFloat = 60.0,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: Optional[PositiveFloat] = None,
        find_unused_parameters: bool = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: Optional[Literal["nccl", "gloo"]] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"`LitDDPStrategy(timeout_s={timeout_s!r})` must be > 0")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"`LitDDPStrategy(bucket_cap_mb={bucket_cap_mb!r})` must be > 0")
        ddp_kwargs = {
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
        }
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            timeout=timedelta(seconds=timeout_s),
            start_method=start_method,
            process_group_backend=process_group_backend,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            checkpoint_io=AtomicCheckpointIO(),
            **ddp_kwargs,
        )
        # NCCL errors and timeouts abort the communicator and raise, instead of leaving ranks stuck.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, (_SubprocessScriptLauncher, _MultiProcessingLauncher)) and not (
            self.cluster_environment.creates_processes_externally
        ):
            # Tells the ranks this process is about to start who their launcher is (see setup_environment).
            os.environ[_LAUNCHER_PID] = str(os.getpid())

    def setup_environment(self) -> None:
        launcher_pid = os.environ.get(_LAUNCHER_PID)
        # Only ranks that Lightning itself started (torchrun's and Slurm's have their own environments, and
        # may have inherited a stale value from a process that once launched ranks).
        if (
            launcher_pid is not None
            and int(launcher_pid) != os.getpid()
            and type(self.cluster_environment) is LightningEnvironment
        ):
            # Lightning's child observer (ddp) runs in rank 0 and watches the children only, and torch's spawn
            # (ddp_spawn) watches from the parent: if that process dies, the ranks it started would wait in a
            # collective until the timeout, or train on, or hang on forever.
            _die_with_parent(int(launcher_pid))
        super().setup_environment()

    def setup_distributed(self) -> None:
        env = self.cluster_environment
        if (
            not torch.distributed.is_initialized()
            and self.num_nodes == 1
            and type(env) is LightningEnvironment
            and env.main_address in ("127.0.0.1", "localhost")
        ):
            # Through env://, the rank-0 TCPStore listens on every interface (*:MASTER_PORT), and torch's
            # SECURITY.md warns that its distributed features accept connections from anywhere. A one-machine run
            # needs loopback only: build the store from a socket bound to 127.0.0.1 and init the process group
            # here; Lightning's _init_dist_connection then sees it initialized and skips its own.
            self.set_world_ranks()
            _init_loopback_process_group(
                self._get_process_group_backend(), env.global_rank(), env.world_size(), env.main_port, self._timeout
            )
        super().setup_distributed()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning kills the ranks it started only on KeyboardInterrupt: a rank 0 that fails otherwise would
        # leave a hung rank behind as an orphan. Rank 0's own error is often only "connection reset by peer":
        # say which rank died first.
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            first_rank = self.node_rank * self.num_processes + 1
            for rank, code in _exited_children(self._launcher.procs, first_rank):
                print(f"lit-ddp-fit: rank {rank} exited with code {code}", file=sys.stderr)
            self._launcher.kill(signal.SIGKILL)

    def wrap_comm_hook(self, wrap: Callable[[Callable], Callable]) -> None:
        """Replaces the comm hook to be registered by ``wrap(hook)``; call before ``setup`` (e.g. in a callback's
        ``setup``). ``hook`` is the configured hook with its wrapper applied, or DDP's plain all-reduce."""
        hook = self._ddp_comm_hook or allreduce_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self._ddp_comm_hook, self._ddp_comm_wrapper = wrap(hook), None

    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (a torch 1.8 limit, see DDPStrategy._register_ddp_hooks);
        # gloo runs them today, and the sync-check fault tests and CommMonitor need them on CPU. Lightning also
        # drops a wrapper given without a hook; here it wraps DDP's plain all-reduce.
        assert isinstance(self.model, DistributedDataParallel)
        hook = self._ddp_comm_hook
        if hook is None and self._ddp_comm_wrapper is not None:
            hook = allreduce_hook
        _register_ddp_comm_hook(self.model, self._ddp_comm_state, hook, self._ddp_comm_wrapper)

    @property
    def ddp_kwargs(self) -> dict:
        """The keyword arguments this strategy passes to ``DistributedDataParallel``."""
        return dict(self._ddp_kwargs)


_LAUNCHER_PID = "LIT_DDP_LAUNCHER_PID"


def _init_loopback_process_group(backend: str, rank: int, world_size: int, port: int, timeout: timedelta) -> None:
    listen_fd = None
    if rank == 0:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        listen_fd = server.detach()  # the store owns the descriptor from here on
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout, master_listen_fd=listen_fd
    )
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _exited_children(procs: list, first_rank: int, wait_s: float = 1.0) -> list[tuple[int, int]]:
    """(global rank, exit code) of the launched ranks that have exited with an error, waiting up to ``wait_s``
    for one to show: rank 0's collective usually fails a moment before the dead rank is reaped."""
    deadline = time.monotonic() + wait_s
    while True:
        exited = [(first_rank + i, p.poll()) for i, p in enumerate(procs)]
        exited = [(rank, code) for rank, code in exited if code not in (None, 0)]
        if exited or time.monotonic() > deadline:
            return exited
        time.sleep(0.05)


def _die_with_parent(parent_pid: int) -> None:
    """The kernel SIGKILLs this process when its parent exits (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the target's own directory, fsyncs it, then renames it over
    the target: a process killed mid-save leaves the previous ``last.ckpt`` whole.

    Lightning's ``_atomic_save`` uses an fsspec transaction, which for local files stages the data in
    ``$TMPDIR`` and *moves* it at commit: across filesystems that is a copy into the target, not atomic.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"`AtomicCheckpointIO` takes no storage_options, got {storage_options!r}")
        target = os.fspath(path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
