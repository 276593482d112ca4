"""Lightning's ``DDPStrategy`` with DDP's own knobs as typed, documented options.

    python -m lit_ddp.fit --trainer.strategy.static_graph true --trainer.strategy.bucket_cap_mb 1

``DDPStrategy`` forwards ``**kwargs`` to ``DistributedDataParallel``, which LightningCLI cannot turn into
options; this subclass names them, so they show in ``--help`` and YAML and are checked on parse. It also
registers comm hooks on gloo (Lightning does on CUDA only), and hands the run's life (launcher, rendezvous,
dead ranks) to ``lit_ddp.run.lifecycle``.
"""

import multiprocessing
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Optional

import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.measure.gradients import check_all_used
from lit_ddp.measure.trials import buffer_sync, powersgd
from lit_ddp.run import lifecycle
from lit_ddp.run.checkpointing import AtomicCheckpointIO
from lit_ddp.run.hangs import diagnose
from lit_ddp.run.rendezvous import init_loopback_process_group


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
        broadcast_buffers: DDP's ``broadcast_buffers``: rank 0's buffers (BatchNorm's running statistics) are sent
            to every rank at each forward. Off, each rank keeps its own (one collective less per step).
        start_method: ``popen`` runs the script again for each rank (Lightning's ``ddp``); ``spawn``
            and ``fork`` start ranks with multiprocessing (``ddp_spawn``, ``ddp_fork``). ``auto``: ``fork``
            for several CPU processes on one Linux machine (the ranks start from the already imported and
            parsed process: no second round of imports), ``popen`` on GPUs and elsewhere.
        process_group_backend: ``nccl`` or ``gloo``; ``None`` picks nccl on CUDA and gloo elsewhere.
        ddp_comm_hook: A DDP communication hook, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``; registered on
            CPU/gloo too. ``...debugging_hooks.noop_hook`` removes the gradient all-reduce (fault injection).
        ddp_comm_wrapper: Wraps ``ddp_comm_hook`` (or the plain all-reduce), e.g.
            ``...default_hooks.fp16_compress_wrapper``.
        powersgd_rank: PowerSGD compression of the gradients (torch's ``powerSGD_hook``, with error feedback) at
            this matrix rank: lossy, far fewer bytes on the wire. Instead of ``ddp_comm_hook``.
        powersgd_start_step: The step from which PowerSGD compresses (plain all-reduces before it; torch's
            default, 1000, as its authors advise for accuracy). At least 2.
    """

    def __init__(
        self,
        timeout_s: PositiveFloat = 60.0,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: Optional[PositiveFloat] = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        start_method: Literal["auto", "popen", "spawn", "fork", "forkserver"] = "auto",
        process_group_backend: Optional[Literal["nccl", "gloo"]] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        powersgd_rank: Optional[PositiveInt] = None,
        powersgd_start_step: PositiveInt = 1000,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"`LitDDPStrategy(timeout_s={timeout_s!r})` must be > 0")
        ddp_comm_state = None
        if powersgd_rank is not None:
            if ddp_comm_hook is not None or ddp_comm_wrapper is not None:
                raise ValueError(
                    "`LitDDPStrategy(powersgd_rank=...)` is a communication hook: give no ddp_comm_hook "
                    "or ddp_comm_wrapper with it"
                )
            if not (powersgd_rank >= 1 and powersgd_start_step >= 2):
                raise ValueError(f"`LitDDPStrategy(powersgd_rank={powersgd_rank!r}, powersgd_start_step="
                                 f"{powersgd_start_step!r})`: the rank must be >= 1, the start step >= 2")  # fmt: skip
            ddp_comm_state, ddp_comm_hook = powersgd(powersgd_rank, powersgd_start_step)
        self.powersgd_rank = powersgd_rank
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"`LitDDPStrategy(bucket_cap_mb={bucket_cap_mb!r})` must be > 0")
        self.timeout_s = timeout_s
        self.ddp_kwargs = {
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
        }
        self.ddp_kwargs.update(buffer_sync(broadcast_buffers))
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        self._backend_choice = process_group_backend
        self._checked_grads = False
        self.start_method_choice = start_method
        super().__init__(
            timeout=timedelta(seconds=timeout_s),
            start_method="popen" if start_method == "auto" else start_method,
            process_group_backend=process_group_backend,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_wrapper=ddp_comm_wrapper,
            checkpoint_io=AtomicCheckpointIO(),
            **self.ddp_kwargs,
        )

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
        _lightning.carry_back_callback_state(self)  # how the ranks' training ended reaches a launching parent
        lifecycle.mark_launcher(self)

    @override
    def setup_environment(self) -> None:
        lifecycle.follow_launcher(self.cluster_environment)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        env = self.cluster_environment
        if (
            not torch.distributed.is_initialized()
            and self.num_nodes == 1
            and type(env) is LightningEnvironment
            and env.main_address in ("127.0.0.1", "localhost")
        ):
            # Lightning's own init (env://) then sees the group initialized and skips it.
            self.set_world_ranks()
            backend = self._backend_choice or ("nccl" if self.root_device.type == "cuda" else "gloo")
            init_loopback_process_group(
                backend, env.global_rank(), env.world_size(), env.main_port, timedelta(seconds=self.timeout_s),
                self.root_device,
            )  # fmt: skip
        super().setup_distributed()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Lightning builds DDP inside `torch.cuda.stream(torch.cuda.Stream())`. DDP's constructor creates the
        # parameters' AccumulateGrad nodes, which remember the stream they were made on; backward then produces
        # gradients on the default stream, and autograd warns "AccumulateGrad node's stream does not match" on
        # every step and syncs the two streams. Build it on the current stream, as the notes' plain DDP does.
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(module=model, device_ids=device_ids, **self.ddp_kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if not self._checked_grads and not self.ddp_kwargs["find_unused_parameters"]:
            self._checked_grads = True  # once: the first backward shows what the graph leaves out
            check_all_used(self.lightning_module, self.lightning_module.trainer.global_step)

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
        try:
            return super().training_step(*args, **kwargs)
        except torch.OutOfMemoryError as err:
            self._out_of_memory(err)
            raise

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
            report = getattr(callback, "on_out_of_memory", None)
            if report is not None:
                report(trainer, exception)

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
