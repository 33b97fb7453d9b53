"""DDP and ZeRO engines: a fixed global batch whatever the world size, with shadow passes for ranks without inputs.

Each micro-batch's mean loss is weighted by ``samples / global samples`` and scaled by the world size, and DDP's own
(C++) all-reduce averages over the world, so the gradients are the *sum* of the weighted ones: the update equals the
mean gradient over the global batch on any world size, with no Python comm hook on the hot path. A rank accumulates
its micro-batches under ``no_sync`` and syncs on its last one, so every rank with inputs runs exactly one all-reduce per
step. A rank with no micro-batch this step (the epoch's tail, a small global batch) runs one *shadow* pass instead: a
forward and backward of a valid sample with its loss multiplied by zero, which joins the same all-reduce with zero
gradients. Every rank thus syncs once per step and steps its optimizer identically, with no Join and no extra
collective (the shadow pass costs one one-sample forward and backward on the idle rank). ZeroRedundancyOptimizer
needs no shadowing: every rank calls ``step()``. Limits of the shadow pass (as FSDP2's): a loss that is NaN or inf on
the shadow sample poisons the step (0 * inf = NaN), and modules with running statistics (BatchNorm) see it in
training mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pliant.worker.contract import LOCAL, Engine, EngineError, GlobalBatch, LossFn, Runner

if TYPE_CHECKING:
    # torch.distributed.optim scripts its functional optimizers with TorchScript when imported (0.2 s on the 2-core
    # machine): only the ZeRO engine imports it, when it makes its optimizer, not every worker's start
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = [
    "DDPEngine",
    "ZeroEngine",
    "broadcast_hyper",
    "broadcast_module",
    "broadcast_numbers",
    "broadcast_optimizer",
    "broadcast_tree",
    "loss_sum",
    "sync_scheduler",
    "to_device",
    "weighted_backward",
]

_DDP_SAMPLE_RATE = 10

logger = logging.getLogger(__name__)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested list/tuple/dict) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def weighted_backward(
    model: torch.nn.Module, loss_fn: LossFn, micro: Any, samples: int, total: int, scale: float = 1.0
) -> tuple[torch.Tensor, int]:
    """Backward of one micro-batch's mean loss weighted by its share of the global batch (times ``scale``, which
    undoes a collective's averaging); returns (the detached loss, samples) for :func:`loss_sum`."""
    loss = loss_fn(model, micro)
    weight = samples * scale / total
    (loss if weight == 1.0 else loss * weight).backward()  # an even split at world W weighs exactly 1
    return loss.detach(), samples


def loss_sum(losses: list[tuple[torch.Tensor, int]]) -> float:
    """Sum of loss * samples over a step's micro-batches, with a single device sync."""
    if len(losses) == 1:
        loss, samples = losses[0]
        return float(loss) * samples
    return float(sum(loss * samples for loss, samples in losses)) if losses else 0.0


class DDPEngine(Engine):
    """torch DDP (its own all-reduce) with world-size-scaled loss weights and Join for idle ranks.

    Args:
        model: the module (moved to ``device``).
        optimizer_class, optimizer_kwargs: the optimizer to build over the model's parameters.
        device: where the model lives.
        group: the process group (default: the world).
        init_sync: DDP broadcasts rank 0's parameters as it wraps (False: a rank joining a running world in place,
            whose state then comes from the rank that holds it, :meth:`sync_state`; rank 0 may be a newcomer).
        runner: what runs each step (:attr:`Engine.runner`; default: the plain local step).
        ddp_kwargs: passed to ``DistributedDataParallel`` (``gradient_as_bucket_view`` is True unless given).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        init_sync: bool = True,
        prepared: torch.optim.Optimizer | None = None,
        runner: Runner = LOCAL,
        **ddp_kwargs: Any,
    ) -> None:
        self.runner = runner
        self.device = device
        self.group = group
        # Gradients as views of DDP's buckets: no separate gradients (the size of the model) to allocate and copy
        # from each step, so a re-formed world's first step touches less fresh memory. A gradient is then a view,
        # which ``detach_()`` refuses: code that needs that builds the engine with ``gradient_as_bucket_view=False``.
        self._ddp_kwargs = {"gradient_as_bucket_view": True, **ddp_kwargs}
        self._wrap(model.to(device), init_sync)
        self._optimizer_args = (optimizer_class, optimizer_kwargs)
        self.optimizer = prepared if prepared is not None else self._optimizer(optimizer_class, optimizer_kwargs)

    @classmethod
    def prepare(
        cls,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
    ) -> torch.optim.Optimizer | None:
        """A replicated optimizer needs no process group: built and its state created before the meeting, which the
        survivors then do not wait for."""
        optimizer = optimizer_class(model.to(device).parameters(), **optimizer_kwargs)
        try:
            _materialize(optimizer)
        except Exception as exc:  # e.g. an optimizer whose step needs a closure: its state is created later, if ever
            logger.warning(
                "the %s's state could not be created ahead (%s: %s); it is created when the state arrives",
                optimizer_class.__name__,
                type(exc).__name__,
                str(exc)[:200],
            )
            return None
        return optimizer

    def _wrap(self, module: torch.nn.Module, init_sync: bool = True) -> None:
        """Wrap ``module`` in DDP over the current world (collective; with ``init_sync`` DDP broadcasts rank 0's
        parameters)."""
        self.world_size = dist.get_world_size(self.group)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        kwargs = self._ddp_kwargs if init_sync else {**self._ddp_kwargs, "init_sync": False}
        # The old world's DDP goes first: its reducer's buckets (the size of the gradients) are freed before the new
        # one allocates its own, instead of both being held while it does.
        self.model = None  # type: ignore[assignment]
        self.model = DistributedDataParallel(module, device_ids=device_ids, process_group=self.group, **kwargs)
        # torch's DDP times the all-reduce of every SAMPLE_RATE-th iteration; the metrics extrapolate from those.
        self.model._set_ddp_runtime_logging_sample_rate(_DDP_SAMPLE_RATE)
        self._last_comm_start = 0
        self._synced_since_sample = 0

    def _optimizer(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(self.model.parameters(), **kwargs)

    movable = True
    replicated = ("model", "optim")
    survives_peer_loss = True

    def forward_backward(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        micros = [(to_device(m, self.device), n) for m, n in zip(batch.micro_batches, batch.micro_sizes, strict=True)]
        self.shadowed = not micros
        if not micros:
            # Idle this step: a zero-weighted shadow pass on a valid sample joins the step's one gradient all-reduce
            # with zero gradients, so the others' sum is unchanged and no rank waits for a Join or a broadcast.
            loss = loss_fn(self.model, to_device(batch.shadow(), self.device))
            (loss * 0.0).backward()
            self._observe_allreduce()
            return 0.0
        total, scale = batch.num_samples, float(self.world_size)
        losses = []  # stay on the device: one sync per step, in loss_sum() below
        if len(micros) > 1:
            with self.model.no_sync():
                for micro, n in micros[:-1]:
                    losses.append(weighted_backward(self.model, loss_fn, micro, n, total, scale))
        losses.append(weighted_backward(self.model, loss_fn, *micros[-1], total, scale))
        self._observe_allreduce()
        return loss_sum(losses)

    def rewrap(self) -> None:
        if self.group is not None:
            raise EngineError(
                "a DDP engine on a custom process group cannot re-form in place; the restart path applies"
            )
        self._wrap(self.module, init_sync=False)  # rank 0 may be a newcomer: the state comes from ``src``

    def sync_state(self, src: int) -> int:
        nbytes = broadcast_module(self.module, src)
        return nbytes + broadcast_optimizer(self.optimizer, src)

    def _observe_allreduce(self) -> None:
        """Report gradient all-reduce time: each iteration torch's DDP sampled counts for the iterations since the
        previous sample (DDP times one iteration in ``_DDP_SAMPLE_RATE``)."""
        self._synced_since_sample += 1
        if self.metrics is None or self._synced_since_sample < _DDP_SAMPLE_RATE:
            return
        data = self.model._get_ddp_logging_data()
        start = data.get("backward_comm_time_start", 0)
        if start and start != self._last_comm_start:
            self._last_comm_start = start
            seconds = data.get("backward_comm_time", 0) / 1e9 * self._synced_since_sample
            self.metrics.observe_collective("grad_allreduce", seconds)
            self._synced_since_sample = 0


class ZeroEngine(DDPEngine):
    """DDP with a ZeroRedundancyOptimizer: each rank keeps the optimizer state of its shard of the parameters.

    Its state for DCP is the model (replicated) and this rank's optimizer shard keyed by parameter name: each rank saves
    only the parameters it owns and loads only those it owns in the new world, so a checkpoint reshards to any world
    size through DCP itself, and no rank ever ships its state to another as a pickle.
    """

    optimizer: ZeroRedundancyOptimizer
    movable = True  # at a step boundary: the shards are gathered, then cut again for the new world
    survives_peer_loss = False  # a dead rank's shard is not on the survivors ...
    sharded = True  # ... but in its buddy's copy (pliant.worker.inplace.buddy), from which the survivors roll back
    replicated = ("model",)  # its "zero_shard" is this rank's own
    MEMORY_SHARE = 0.8  # moving in place needs the whole optimizer state on every rank; at most this much free RAM

    @classmethod
    def prepare(
        cls,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
    ) -> torch.optim.Optimizer | None:
        return None  # ZeRO partitions its optimizer over the process group

    def _optimizer(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self._full: torch.optim.Optimizer | None = None
        return ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=cls, **kwargs)

    def _template(self) -> torch.optim.Optimizer:
        """A plain optimizer of the same class over every parameter, with its state tensors created (zero rate)."""
        cls, kwargs = self._optimizer_args
        full = cls(self.module.parameters(), **kwargs)
        for group, zero_group in zip(full.param_groups, self.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in zero_group.items() if k != "params"})
        _materialize(full)
        return full

    def can_move(self) -> bool:
        """The gathered state (every parameter's optimizer state, as DDP holds it) must fit in free host memory."""
        import psutil

        local = [
            v for state in self.optimizer.optim.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        ]
        per_param = len(local) / max(1, len(self.optimizer.optim.state))
        need = per_param * sum(p.numel() * p.element_size() for p in self.module.parameters())
        return need <= self.MEMORY_SHARE * psutil.virtual_memory().available

    def before_move(self) -> None:
        """Every rank gathers the whole optimizer state from the shards' owners (one broadcast per state tensor)."""
        _materialize_zero_state(self.optimizer)
        full = self._template()
        owner = self.optimizer._param_to_rank
        me = dist.get_rank()
        for group in full.param_groups:
            for param in group["params"]:
                state = full.state[param]
                for key in sorted(state):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        continue
                    if owner[param] == me:
                        value.copy_(self.optimizer.optim.state[param][key])
                    dist.broadcast(value, owner[param])
        self._full = full

    def rewrap(self) -> None:
        super().rewrap()
        cls, kwargs = self._optimizer_args
        full, self.optimizer = self._full, self._optimizer(cls, kwargs)
        self._full = full
        self.rebind_scheduler()

    def sync_state(self, src: int) -> int:
        """The gathered state from ``src`` to the newcomers, then each rank keeps its new shard of it."""
        nbytes = broadcast_module(self.module, src)
        full, self._full = self._full or self._template(), None
        nbytes += broadcast_optimizer(full, src)
        for group, hyper in zip(self.optimizer.param_groups, full.param_groups, strict=True):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        for group in self.optimizer.optim.param_groups:
            for param in group["params"]:
                self.optimizer.optim.state[param] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full.state[param].items()
                }
        return nbytes

    def _layout(self, owner: int, partition: list[int], state: dict[Any, dict[str, Any]]) -> list[torch.Tensor]:
        """Old rank ``owner``'s shard: its parameters with their optimizer state tensors (by key), then on rank 0 the
        module's buffers (replicated, so rank 0's stand for all)."""
        out: list[torch.Tensor] = []
        for index, param in enumerate(self.module.parameters()):
            if partition[index] == owner:
                slot = state.get(param, {})
                out += [param.data, *(slot[k] for k in sorted(slot) if isinstance(slot[k], torch.Tensor))]
        if owner == 0:
            out += [buffer.data for buffer in self.module.buffers()]
        return out

    def shard(self) -> tuple[list[int], list[torch.Tensor]]:
        owner = self.optimizer._param_to_rank
        partition = [owner[param] for param in self.module.parameters()]
        return partition, self._layout(dist.get_rank(), partition, self.optimizer.optim.state)

    def rebuild(
        self, partition: list[int], receive: Callable[[int, int], torch.Tensor], hyper: list[dict[str, Any]] | None
    ) -> int:
        from pliant.worker.inplace.packing import packed_size, unpack

        full = self._template()
        for group, saved in zip(full.param_groups, hyper or [], strict=False):
            group.update(saved)
        nbytes = 0
        for owner in sorted({0, *partition}):
            tensors = self._layout(owner, partition, full.state)
            buffer = receive(owner, packed_size(tensors))
            unpack(buffer, tensors)
            nbytes += buffer.numel()
        self._full = full
        return nbytes

    def saved_by(self) -> dict[tuple[str, ...], int]:
        """Each parameter by the rank that owns it, the buffers by rank 0: as :meth:`shard` cuts the state."""
        owner = self.optimizer._param_to_rank
        out = {("model", name): owner[param] for name, param in self.module.named_parameters()}
        return out | {("model", name): 0 for name, _ in self.module.named_buffers()}

    def state_dict(self) -> dict[str, Any]:
        _materialize_zero_state(self.optimizer)
        return {"model": self.module.state_dict(), "zero_shard": _zero_local_state(self.optimizer, self.module)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        _load_zero_local_state(self.optimizer, self.module, state["zero_shard"])


def _materialize_zero_state(optimizer: ZeroRedundancyOptimizer) -> None:
    """Create a fresh ZeRO optimizer's state tensors (momentum, moments) with a zero-learning-rate step, so DCP has a
    template to load into (DCP's own state-dict helpers do the same for plain optimizers). Collective."""
    if not any(optimizer.optim.state.values()):
        _materialize(optimizer)


def _zero_local_state(optimizer: ZeroRedundancyOptimizer, model: torch.nn.Module) -> dict[str, Any]:
    """This rank's ZeRO optimizer shard keyed by parameter name (``<fqn>.<state key>``), plus the hyperparameters.

    Each rank saves only the parameters it owns and loads only those it owns in the new world, so a checkpoint
    reshards to any world size through DCP itself: no rank ever ships its state to another as a pickle.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    state: dict[str, Any] = {}
    for group in optimizer.optim.param_groups:
        for param in group["params"]:
            for key, value in optimizer.optim.state.get(param, {}).items():
                state[f"{names[id(param)]}.{key}"] = value
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "groups": groups}


def _load_zero_local_state(optimizer: ZeroRedundancyOptimizer, model: torch.nn.Module, saved: dict[str, Any]) -> None:
    params = dict(model.named_parameters())
    for flat, value in saved["state"].items():
        name, key = flat.rsplit(".", 1)
        slot = optimizer.optim.state[params[name]]
        if isinstance(value, torch.Tensor) and isinstance(slot.get(key), torch.Tensor):
            if slot[key] is not value:
                slot[key].copy_(value)
        else:
            slot[key] = value
    for group, hyper in zip(optimizer.param_groups, saved["groups"], strict=True):
        group.update(hyper)  # ZeRO copies these to its local optimizer at every step


# -- state for newcomers, over the process group (tensors only: nothing crosses ranks as pickle) -----------------------


def broadcast_module(module: torch.nn.Module, src: int) -> int:
    """Send rank ``src``'s parameters and buffers to every rank, in place. Returns the tensor bytes moved."""
    nbytes = 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src)
            nbytes += tensor.numel() * tensor.element_size()
    return nbytes


def _numeric(value: object) -> bool:
    return isinstance(value, (int, float))  # bool included


def broadcast_hyper(optimizer: torch.optim.Optimizer, src: int) -> None:
    """Make every rank's numeric hyperparameters (a scheduler's learning rate) equal to rank ``src``'s."""
    groups = optimizer.param_groups
    keys = [sorted(k for k, v in g.items() if k != "params" and _numeric(v)) for g in groups]
    hyper = torch.tensor([float(g[k]) for g, ks in zip(groups, keys, strict=True) for k in ks], dtype=torch.float64)
    dist.broadcast(hyper, src)
    values = iter(hyper.tolist())
    for group, ks in zip(groups, keys, strict=True):
        for key in ks:
            value = next(values)
            group[key] = type(group[key])(value) if not isinstance(group[key], bool) else bool(value)


def broadcast_optimizer(optimizer: torch.optim.Optimizer, src: int) -> int:
    """Make every rank's optimizer state and numeric hyperparameters (a scheduler's learning rate) equal to rank
    ``src``'s. A rank with no state yet (a newcomer) first creates it with a zero-learning-rate step, as DCP's
    state-dict helpers do, so every rank holds the same tensors to receive into. Returns the tensor bytes moved."""
    flag = torch.tensor([int(any(optimizer.state.values()))], dtype=torch.int64)
    dist.broadcast(flag, src)
    groups = optimizer.param_groups
    broadcast_hyper(optimizer, src)
    if not flag.item():
        return 0
    if not any(optimizer.state.values()):
        _materialize(optimizer)
    return sum(broadcast_tree(optimizer.state[param], src) for group in groups for param in group["params"])


def broadcast_tree(tree: dict[str, Any], src: int) -> int:
    """Broadcast the tensors (in place) and numbers of a nested dict from ``src``, in sorted key order (every rank
    holds the same keys and shapes). Returns the tensor bytes."""
    nbytes = 0
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            nbytes += broadcast_tree(value, src)
        elif isinstance(value, torch.Tensor):
            dist.broadcast(value, src)
            nbytes += value.numel() * value.element_size()
        elif _numeric(value):
            box = torch.tensor([float(value)], dtype=torch.float64)
            dist.broadcast(box, src)
            tree[key] = type(value)(box.item())
    return nbytes


def _numbers(tree: Any, out: list[float]) -> None:
    """The numbers of a nested dict/list, in a fixed order (dicts by sorted key), appended to ``out``."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            _numbers(tree[key], out)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _numbers(value, out)
    elif _numeric(tree):
        out.append(float(tree))


def _refill(tree: Any, values: Any) -> Any:
    """``tree`` with its numbers taken in turn from the iterator ``values`` (the order of :func:`_numbers`)."""
    if isinstance(tree, dict):
        return {key: _refill(tree[key], values) for key in sorted(tree, key=str)}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_refill(value, values) for value in tree)
    if _numeric(tree):
        value = next(values)
        return bool(value) if isinstance(tree, bool) else type(tree)(value)
    return tree


def broadcast_numbers(tree: Any, src: int) -> Any:
    """Rank ``src``'s numbers in a nested dict/list of the same structure on every rank (a scheduler's state: its
    step count, last learning rates), in one float64 broadcast. Returns the tree with them; what is not a number
    (a name, a None) stays as this rank has it."""
    flat: list[float] = []
    _numbers(tree, flat)
    box = torch.tensor(flat, dtype=torch.float64)
    dist.broadcast(box, src)
    return _refill(tree, iter(box.tolist()))


def sync_scheduler(engine: Engine, src: int) -> int:
    """Make ``engine``'s learning-rate scheduler state (if it has one) equal to rank ``src``'s (collective). Returns
    the bytes moved."""
    if engine.scheduler is None:
        return 0
    state = broadcast_numbers(engine.scheduler.state_dict(), src)
    engine.scheduler.load_state_dict(state)
    numbers: list[float] = []
    _numbers(state, numbers)
    return 8 * len(numbers)


def _materialize(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state tensors with a zero-learning-rate step on zero gradients (local)."""
    saved = [(group, group["lr"]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in saved:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
