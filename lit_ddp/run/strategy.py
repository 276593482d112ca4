"""Lightning's ``DDPStrategy`` with DDP's own knobs as typed, documented options.

    python -m lit_ddp.fit --trainer.strategy.static_graph true --trainer.strategy.bucket_cap_mb 1

It takes every argument ``DDPStrategy`` takes, with the same meaning (``**kwargs`` go to
``DistributedDataParallel``), and names DDP's knobs besides, which LightningCLI cannot find in ``**kwargs``: they
show in ``--help`` and YAML and are checked on parse; like ``**kwargs`` they reach DDP only when given. Where it
differs from ``DDPStrategy`` on purpose (``start_method="auto"``, the 60 s timeout, comm hooks on CPU, the
loopback rendezvous, the unused-parameter check), docs/architecture.md says why. The run's life (launcher, dead
ranks) is ``lit_ddp.run.lifecycle``'s.
"""

import multiprocessing
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.measure.gradients import check_all_used
from lit_ddp.run import console, launchers, lifecycle, watchdog
from lit_ddp.run.checkpointing import AtomicCheckpointIO
from lit_ddp.run.ddp_options import buffer_sync, powersgd
from lit_ddp.run.hangs import diagnose
from lit_ddp.run.rendezvous import START_TIMEOUT, init_loopback_process_group, init_process_group
from lit_ddp.run.roles import ReportsOutOfMemory

# Lightning's default is torch's 30 minutes: a hung rank would stall the job that long (docs/architecture.md).
DEFAULT_TIMEOUT = timedelta(seconds=60)


class LitDDPStrategy(DDPStrategy):
    """DDP with a short process-group timeout and DDP's bucket and graph options exposed.

    The first twelve arguments are ``DDPStrategy``'s, in its order and with its meaning (two defaults differ:
    ``timeout`` and ``start_method``); the rest are lit_ddp's. Of DDP's options (``static_graph`` to
    ``broadcast_buffers``, and ``**kwargs``) only those given reach DDP: ``None`` leaves torch's default.

    Args:
        accelerator: As ``DDPStrategy``'s; the Trainer sets it.
        parallel_devices: As ``DDPStrategy``'s; the Trainer sets it.
        cluster_environment: As ``DDPStrategy``'s; the Trainer finds it (Lightning's, torchrun's, Slurm's).
        checkpoint_io: How checkpoints are written. ``None`` (and no ``CheckpointIO`` in the Trainer's plugins):
            ``AtomicCheckpointIO``, which writes a temporary file and renames it over the target.
        precision_plugin: As ``DDPStrategy``'s; the Trainer sets it.
        ddp_comm_state: The state of ``ddp_comm_hook`` (e.g. a ``PostLocalSGDState``, or PowerSGD's).
        ddp_comm_hook: A DDP communication hook, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``; registered on
            CPU/gloo too. ``...debugging_hooks.noop_hook`` removes the gradient all-reduce (fault injection).
        ddp_comm_wrapper: Wraps ``ddp_comm_hook`` (or the plain all-reduce), e.g.
            ``...default_hooks.fp16_compress_wrapper``.
        model_averaging_period: With a ``PostLocalSGDState``: average the models every this many steps.
        process_group_backend: ``nccl``, ``gloo`` or any backend string torch takes; ``None`` picks nccl on CUDA
            and gloo elsewhere.
        timeout: How long a collective may wait before the process group aborts (Lightning's default: 30
            minutes, so a hung rank stalls the job that long). ``None``: torch's default.
        start_method: ``popen`` runs the script again for each rank (Lightning's ``ddp``); ``spawn``
            and ``fork`` start ranks with multiprocessing (``ddp_spawn``, ``ddp_fork``). ``auto``: ``fork``
            for several CPU processes on one Linux machine (the ranks start from the already imported and
            parsed process: no second round of imports), ``popen`` on GPUs and elsewhere.
        timeout_s: ``timeout`` in seconds, the command line's spelling (``--trainer.strategy.timeout_s 10``).
        static_graph: DDP's ``static_graph``: the graph is the same every step, which lets DDP skip
            the unused-parameter search and reorder buckets after the first step.
        gradient_as_bucket_view: Gradients are views into DDP's all-reduce buckets (saves a copy and memory).
        bucket_cap_mb: DDP's gradient bucket size in MiB (torch's default: 25). Smaller buckets start
            all-reducing earlier in backward, at the cost of more messages.
        find_unused_parameters: Search the graph for parameters without gradients every step. Off (torch's
            default), a parameter without a gradient in the first step is an error naming it.
        broadcast_buffers: DDP's ``broadcast_buffers``: rank 0's buffers (BatchNorm's running statistics) are sent
            to every rank at each forward (torch's default). Off, each rank keeps its own (one collective less
            per step); given as ``forward_sync_buffers`` where torch has renamed it.
        powersgd_rank: PowerSGD compression of the gradients (torch's ``powerSGD_hook``, with error feedback) at
            this matrix rank: lossy, far fewer bytes on the wire. Instead of ``ddp_comm_hook``.
        powersgd_start_step: The step from which PowerSGD compresses (plain all-reduces before it; torch's
            default, 1000, as its authors advise for accuracy). At least 2.
        **kwargs: More of ``DistributedDataParallel``'s arguments (``process_group``, ``init_sync``, ...).
    """

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        start_method: Literal["auto", "popen", "spawn", "fork", "forkserver"] = "auto",
        timeout_s: Optional[PositiveFloat] = None,
        static_graph: Optional[bool] = None,
        gradient_as_bucket_view: Optional[bool] = None,
        bucket_cap_mb: Optional[PositiveFloat] = None,
        find_unused_parameters: Optional[bool] = None,
        broadcast_buffers: Optional[bool] = None,
        powersgd_rank: Optional[PositiveInt] = None,
        powersgd_start_step: PositiveInt = 1000,
        **kwargs: Any,
    ) -> None:
        if timeout_s is not None:
            if not timeout_s > 0:
                raise ValueError(f"`LitDDPStrategy(timeout_s={timeout_s!r})` must be > 0")
            if timeout not in (DEFAULT_TIMEOUT, timedelta(seconds=timeout_s)):
                raise ValueError(f"`LitDDPStrategy(timeout={timeout!r}, timeout_s={timeout_s!r})`: two timeouts, "
                                 "give one")  # fmt: skip
            timeout = timedelta(seconds=timeout_s)
        if timeout is not None and not timeout > timedelta(0):
            raise ValueError(f"`LitDDPStrategy(timeout={timeout!r})` must be > 0")
        if powersgd_rank is not None:
            if ddp_comm_hook is not None or ddp_comm_wrapper is not None or ddp_comm_state is not None:
                raise ValueError(
                    "`LitDDPStrategy(powersgd_rank=...)` is a communication hook: give no ddp_comm_hook, "
                    "ddp_comm_wrapper or ddp_comm_state with it"
                )
            if not (powersgd_rank >= 1 and powersgd_start_step >= 2):
                raise ValueError(f"`LitDDPStrategy(powersgd_rank={powersgd_rank!r}, powersgd_start_step="
                                 f"{powersgd_start_step!r})`: the rank must be >= 1, the start step >= 2")  # fmt: skip
            ddp_comm_state, ddp_comm_hook = powersgd(powersgd_rank, powersgd_start_step)
        self.powersgd_rank = powersgd_rank
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"`LitDDPStrategy(bucket_cap_mb={bucket_cap_mb!r})` must be > 0")
        named = {"static_graph": static_graph, "gradient_as_bucket_view": gradient_as_bucket_view,
                 "bucket_cap_mb": bucket_cap_mb, "find_unused_parameters": find_unused_parameters}  # fmt: skip
        ddp_kwargs = {name: value for name, value in named.items() if value is not None}
        if broadcast_buffers is not None:
            ddp_kwargs.update(buffer_sync(broadcast_buffers))
        # Merged here, not passed on as `**kwargs`: jsonargparse would follow those into DDP's signature and give DDP
        # every one of its defaults explicitly; a config names the options above.
        ddp_kwargs.update(kwargs)
        self._checked_grads = False
        self.start_method_choice = start_method
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen" if start_method == "auto" else start_method,
            **ddp_kwargs,
        )

    @property
    def timeout_s(self) -> Optional[float]:
        """The process-group timeout in seconds (``None``: torch's default)."""
        return self._timeout.total_seconds() if self._timeout is not None else None

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """The arguments DDP is built with: those given, no more (Lightning keeps them in ``_ddp_kwargs``)."""
        return self._ddp_kwargs

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Atomic writes unless a CheckpointIO was given, here or in the Trainer's plugins: decided when first
        # asked, so that the Trainer still sees no checkpoint_io of the strategy's while it builds.
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @override
    def _configure_launcher(self) -> None:
        if self.start_method_choice == "auto":
            # CUDA must not be initialised before a fork, and a forked rank cannot be a node of a multi-node job.
            fork = (
                not self.cluster_environment.creates_processes_externally  # torchrun, Slurm: started already
                and self.root_device.type == "cpu"
                and self.num_processes > 1
                and self.num_nodes == 1
                and "fork" in multiprocessing.get_all_start_methods()
            )
            self._start_method = "fork" if fork else "popen"
        super()._configure_launcher()
        launchers.replace_launcher(self)

    @override
    def setup_environment(self) -> None:
        lifecycle.follow_launcher(self.cluster_environment)
        env = self.cluster_environment
        watchdog.start(env.global_rank(), self.num_nodes * self.num_processes)  # before the rendezvous
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        env = self.cluster_environment
        if not torch.distributed.is_initialized() and type(env) is LightningEnvironment:
            # Lightning's own init (env://) then sees the group initialized and skips it.
            self.set_world_ranks()
            backend, rank, world_size = self._get_process_group_backend(), env.global_rank(), env.world_size()
            if self.num_nodes == 1 and env.main_address in ("127.0.0.1", "localhost"):
                init_loopback_process_group(backend, rank, world_size, env.main_port, self._timeout, self.root_device)
            else:  # several nodes: the start's timeout is the collectives' (60 s by default)
                started = {"host": socket.gethostname(), "num_nodes": self.num_nodes, "devices": self.num_processes}
                init_process_group(backend, rank, world_size, env.main_address, env.main_port, self._timeout,
                                   self.root_device, self._timeout or START_TIMEOUT, started,
                                   self.num_processes)  # fmt: skip
        super().setup_distributed()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Lightning 2.6 builds DDP under a new CUDA side stream, which whole-step CUDA-graph capture needs (torch's
        # CUDA notes). Outside a capture, DDP's AccumulateGrad nodes then remember a stream the backward does not
        # run on: autograd warns "AccumulateGrad node's stream does not match" at every backward and syncs the two
        # (lightning#21567). As Lightning's master does since lightning#21746, not yet released: the side stream
        # while capturing, the default stream otherwise; on CPU, Lightning's own.
        device_ids = self.determine_ddp_device_ids()
        if device_ids is None or torch.cuda.is_current_stream_capturing():
            return super()._setup_model(model)
        with torch.cuda.stream(torch.cuda.default_stream()):
            return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if not self._checked_grads and not self._ddp_kwargs.get("find_unused_parameters", False):
            self._checked_grads = True  # once: the first backward shows what the graph leaves out
            trainer = self.lightning_module.trainer
            check_all_used(self.lightning_module, trainer.global_step, console.advice(trainer))

    @override
    def teardown(self) -> None:
        super().teardown()
        if multiprocessing.parent_process() is not None and _lightning.trains_in_children(self):
            # A ddp_spawn/ddp_fork rank that finished (exceptions skip teardown there): destroy the process
            # group while every rank is alive, or gloo's threads may abort the interpreter's exit ("terminate
            # called without an active exception", seen under ddp_spawn).
            lifecycle.teardown_process_group()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        watchdog.beat(self.lightning_module.trainer.global_step)  # a clock read, at a new step only
        try:
            return super().training_step(*args, **kwargs)
        except torch.OutOfMemoryError as err:
            self._out_of_memory(err)
            raise

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        watchdog.alive()
        return super().validation_step(*args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        try:  # automatic optimization: the closure's forward and backward, then the update
            return super().optimizer_step(*args, **kwargs)
        except torch.OutOfMemoryError as err:
            self._out_of_memory(err)
            raise

    def _out_of_memory(self, exception: BaseException) -> None:
        # Where the rank that ran out of memory still runs: a ddp_spawn/ddp_fork rank reaches no callback's
        # on_exception, and the others may be waiting in a collective. PhaseTimer says where and what held it.
        trainer = self.lightning_module.trainer
        for callback in trainer.callbacks:
            if isinstance(callback, ReportsOutOfMemory):
                callback.on_out_of_memory(trainer, exception)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Where DDP waits for every rank's gradients: a timeout here names the ranks that never arrived. (Here
        # and not in on_exception: ddp_fork/ddp_spawn ranks never call it.)
        try:
            return super().backward(closure_loss, *args, **kwargs)
        except Exception as err:
            self._name_absent_ranks(err)
            raise

    def _name_absent_ranks(self, exception: BaseException) -> None:
        per_node = self.num_processes if self.num_nodes > 1 else None  # several nodes: name each rank's node
        diagnose(self.lightning_module.trainer, exception, per_node)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if torch.distributed.is_initialized():
            self._name_absent_ranks(exception)
        lifecycle.stop_launched_ranks(self, first_rank=self.node_rank * self.num_processes + 1)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (a torch 1.8 limit, see DDPStrategy._register_ddp_hooks);
        # gloo runs them today, and the sync-check fault tests and CommMonitor need them on CPU. Lightning also
        # drops a wrapper given without a hook; here it wraps DDP's plain all-reduce.
        assert isinstance(self.model, DistributedDataParallel)
        configured = _lightning.configured_comm_hook(self)
        hook = configured.hook
        if hook is None and configured.wrapper is not None:
            hook = allreduce_hook
        _lightning.register_comm_hook(self.model, configured.state, hook, configured.wrapper)
