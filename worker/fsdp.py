"""The FSDP2 engine (``fully_shard``) and pliant's Join hook for it.

FSDP2 is not Joinable in torch: every forward all-gathers parameters and every synced backward reduce-scatters
gradients, so ranks must run the same number of passes or the collectives hang. When ranks have different numbers of
micro-batches this step, the step runs inside torch's ``Join`` context with :class:`FSDPJoinable`: a rank that ran out
of micro-batches runs, for each further iteration of the others, a *shadow* forward/backward on a valid one-sample
batch with its loss multiplied by zero. It replays the same all-gathers and reduce-scatters, contributes zero gradient,
and receives its shard of the summed gradient like everyone else.

Limits of the shadow pass: the model's forward must issue the same FSDP collectives whatever the input (no
data-dependent choice of sub-modules, e.g. token-routed experts); modules with running statistics (BatchNorm) see the
shadow sample in training mode; a loss that is NaN/inf on the shadow sample poisons the step (0 * inf = NaN).

**In place** (under the rescale protocol): ``fully_shard`` cannot move a sharded module to another mesh, so at a step
boundary every rank gathers the full model and optimizer state (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict``: torch's own all-gathers) while the old world is whole; then it
takes FSDP2 back off the script's own module objects (:func:`pliant.worker.fsdp_release.release`) and shards the same
objects over the new world, and the source rank's full state is broadcast to every rank (newcomers included) and
loaded with ``set_model_state_dict`` / ``set_optimizer_state_dict``, which cut each rank's shard. The module the
script passed in therefore stays the model through every re-form: ``model.state_dict()``, ``model.parameters()``,
``model(x)``, its sub-modules and the hooks the script registered on them all see the live, re-sharded model
(``engine.module`` is the same object). Parameter objects are new at every re-form: the engine's optimizer is built
again over them, and a parameter or an optimizer the script took before a rescale raises
:class:`pliant.worker.fsdp_release.StaleParameterError` when used.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from pliant.worker.contract import LOCAL, Engine, EngineError, GlobalBatch, LossFn, Runner
from pliant.worker.engines import (
    _materialize,
    broadcast_hyper,
    broadcast_tree,
    loss_sum,
    to_device,
    weighted_backward,
)
from pliant.worker.fsdp_release import release, unsupported

__all__ = ["FSDPEngine", "FSDPJoinable"]

logger = logging.getLogger(__name__)


class _ShadowHook(JoinHook):
    def __init__(self, joinable: FSDPJoinable) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        """One shadow iteration: the same forward/backward collectives as the others' next micro-batch."""
        self.joinable.shadow_iteration()


class FSDPJoinable(Joinable):
    """Makes an FSDP2 model joinable for one step at a time (see the module docstring)."""

    def __init__(self, engine: FSDPEngine) -> None:
        super().__init__()
        self.engine = engine
        self.iteration = 0
        self.iterations = 0
        self.loss_fn: LossFn | None = None
        self.shadow: Callable[[], Any] = lambda: None

    def begin(self, batch: GlobalBatch, loss_fn: LossFn) -> None:
        self.iteration, self.iterations = 0, max(batch.plan.counts())
        self.loss_fn, self.shadow = loss_fn, batch.shadow

    def sync_now(self) -> bool:
        """Gradients are reduce-scattered on the step's last iteration only (accumulated before)."""
        return self.iteration == self.iterations - 1

    def shadow_iteration(self) -> None:
        assert self.loss_fn is not None
        self.engine.model.set_requires_gradient_sync(self.sync_now())
        loss = self.loss_fn(self.engine.model, to_device(self.shadow(), self.engine.device))
        (loss * 0.0).backward()
        self.iteration += 1

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.engine.device

    @property
    def join_process_group(self) -> Any:
        return self.engine.group or dist.group.WORLD


_MESHES = itertools.count()  # the number in each mesh's name: see FSDPEngine._build


def _default_shard(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Shard each direct child that holds parameters, then the root (FSDP2's usual recipe)."""
    return [m for m in model.children() if any(True for _ in m.parameters())]


class FSDPEngine(Engine):
    """FSDP2 with summed gradients and shadow passes for ranks with fewer micro-batches.

    Args:
        model: the module (moved to ``device``, then sharded in place).
        optimizer_class, optimizer_kwargs: the optimizer, built over the sharded parameters.
        device: where the model lives.
        group: unused with FSDP2 (the world mesh is used); must be None.
        shard: returns the sub-modules to ``fully_shard`` before the root (default: its direct children).
        runner: what runs each step (:attr:`Engine.runner`; default: the plain local step).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        shard: Callable[[torch.nn.Module], list[torch.nn.Module]] = _default_shard,
        runner: Runner = LOCAL,
    ) -> None:
        self.runner = runner
        if group is not None:
            raise EngineError("the fsdp engine shards over the whole world; drop the group argument")
        self.device, self.group = device, group
        self._shard = shard
        self._optimizer_args = (optimizer_class, optimizer_kwargs)
        self._full: tuple[dict[str, Any], dict[str, Any]] | None = None
        why = unsupported()
        if why:
            self.movable = False
            logger.warning("%s", why)
        self._build(model.to(device))

    def _build(self, model: torch.nn.Module) -> None:
        """Shard ``model`` over the current world and build its optimizer.

        The mesh is named anew for every world this process shards over (:data:`_MESHES`): torch's DTensor caches
        compare meshes by their ranks, layout and names, not by this process's place in them, so a later world of the
        same size, in which this process holds another rank (a node before it left), would get DTensors on the
        earlier mesh back, whose coordinate is this process's old rank: loading the state would cut another rank's
        share (and fail on uneven rows), and DCP takes each shard's global offset from it."""
        mesh = self._mesh()
        for module in self._shard(model):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        # FSDP2 averages reduce-scattered gradients over the world (a premultiplied sum gloo cannot do otherwise);
        # losses are weighted by the world size to undo it, so gradients are sums as in the DDP engines.
        self.world_size = dist.get_world_size()
        cls, kwargs = self._optimizer_args
        self.optimizer = cls(model.parameters(), **kwargs)
        self.joinable = FSDPJoinable(self)

    def _mesh(self) -> DeviceMesh:
        """The current world's mesh: one dimension, every rank."""
        return init_device_mesh(
            self.device.type, (dist.get_world_size(),), mesh_dim_names=(f"pliant-fsdp-{next(_MESHES)}",)
        )

    movable = True  # at a step boundary: the full state is gathered, the model sharded again over the new world
    MEMORY_SHARE = 0.8  # the full model and optimizer state must fit in this share of the free host memory

    def can_move(self) -> bool:
        """The full model and optimizer state must fit in free host memory on every rank (and this torch's FSDP2 must
        be one the engine can release: :func:`pliant.worker.fsdp_release.unsupported`)."""
        import psutil

        if not self.movable:
            return False

        local = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        per_param = len(local) / max(1, len(self.optimizer.state))
        need = (1 + per_param) * sum(p.numel() * p.element_size() for p in self.model.parameters())
        return need <= self.MEMORY_SHARE * psutil.virtual_memory().available

    def before_move(self) -> None:
        """Every rank gathers the full model and optimizer state over the old world (torch's all-gathers)."""
        options = StateDictOptions(full_state_dict=True)
        self._full = (
            get_model_state_dict(self.model, options=options),
            get_optimizer_state_dict(self.model, self.optimizer, options=options),
        )

    def rewrap(self) -> None:
        """The script's module, released from the old world's mesh and sharded over the new one (the same objects; its
        buffers kept); its parameters' values come in :meth:`sync_state`."""
        release(self.model, self.device)
        self._build(self.model)
        self.rebind_scheduler()

    def sync_state(self, src: int) -> int:
        """Rank ``src``'s full model and optimizer state to every rank, each of which loads its new shard of it."""
        options = StateDictOptions(full_state_dict=True)
        full, self._full = self._full, None
        model_sd = (
            full[0] if full is not None else {k: _empty(v, self.device) for k, v in self.model.state_dict().items()}
        )
        nbytes = broadcast_tree(model_sd, src)
        set_model_state_dict(self.model, model_sd, options=options)
        flag = torch.tensor([int(full is not None and bool(full[1]["state"]))], dtype=torch.int64)
        dist.broadcast(flag, src)
        if flag.item():
            optim_sd = full[1] if full is not None else self._optimizer_template()
            nbytes += broadcast_tree(optim_sd["state"], src)
            set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=options)
        broadcast_hyper(self.optimizer, src)
        return nbytes

    sharded = True  # every parameter is cut across the ranks: a death is survived through buddy copies

    @staticmethod
    def _layout(
        rows: Callable[[torch.Tensor], torch.Tensor],
        first: bool,
        model: dict[str, torch.Tensor],
        state: dict[str, dict[str, Any]],
        buffers: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """One old rank's shard, in a fixed order: ``rows`` of every parameter (``model``: name -> tensor) and of its
        optimizer state tensors (``state``: name -> key -> tensor), then, on the ``first`` rank only, the replicated
        state (0-dim: a step count) and the module's buffers."""
        out: list[torch.Tensor] = []
        for name in model:
            slot = state.get(name, {})
            keys = [k for k in sorted(slot) if isinstance(slot[k], torch.Tensor)]
            out += [rows(model[name]), *(rows(slot[k]) for k in keys if slot[k].dim() > 0)]
            out += [slot[k] for k in keys if slot[k].dim() == 0] if first else []
        return out + (buffers if first else [])

    def shard(self) -> tuple[list[int], list[torch.Tensor]]:
        params = dict(self.model.named_parameters())
        names = {param: name for name, param in params.items()}
        local = {name: _local(p) for name, p in params.items()}
        state = {names[p]: {k: _local(v) for k, v in s.items()} for p, s in self.optimizer.state.items()}
        buffers = [b.data for b in self.model.buffers()]
        tensors = self._layout(lambda t: t, dist.get_rank() == 0, local, state, buffers)
        return [dist.get_world_size()] * len(params), tensors

    def rebuild(
        self, partition: list[int], receive: Callable[[int, int], torch.Tensor], hyper: list[dict[str, Any]] | None
    ) -> int:
        from pliant.worker.inplace.packing import packed_size, unpack

        world = partition[0] if partition else 1
        template = self._optimizer_template()
        model = {name: _empty(p, self.device) for name, p in self.model.named_parameters()}
        buffers = [b.data for b in self.model.buffers()]
        nbytes = 0
        for owner in range(world):
            tensors = self._layout(lambda t, o=owner: _rows(t, o, world), owner == 0, model, template["state"], buffers)
            buffer = receive(owner, packed_size(tensors))
            unpack(buffer, tensors)
            nbytes += buffer.numel()
        for group, saved in zip(template["param_groups"], hyper or [], strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
        persistent = {name: b for name, b in self.model.named_buffers() if name in self.model.state_dict()}
        self._full = ({**model, **{k: v.detach().clone() for k, v in persistent.items()}}, template)
        return nbytes

    def _optimizer_template(self) -> dict[str, Any]:
        """A full optimizer state dict (by parameter name) shaped as the source's, to receive into."""
        if not any(self.optimizer.state.values()):
            _materialize(self.optimizer)
        names = {param: name for name, param in self.model.named_parameters()}
        state = {
            names[p]: {k: _empty(v, self.device) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
            for g in self.optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    @property
    def fsdp(self) -> FSDPModule:
        assert isinstance(self.model, FSDPModule)
        return self.model

    def forward_backward(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        micros = list(zip(batch.micro_batches, batch.micro_sizes, strict=True))
        total = batch.num_samples
        losses = []  # stay on the device: one sync per step, in loss_sum() below
        joinable = self.joinable
        joinable.begin(batch, loss_fn)
        with Join([joinable]) if batch.plan.uneven else nullcontext():
            for micro, n in micros:
                if batch.plan.uneven:
                    Join.notify_join_context(joinable)
                self.fsdp.set_requires_gradient_sync(joinable.sync_now())
                micro = to_device(micro, self.device)
                losses.append(weighted_backward(self.model, loss_fn, micro, n, total, self.world_size))
                joinable.iteration += 1
        self.fsdp.set_requires_gradient_sync(True)
        self.shadowed = len(micros) < joinable.iterations
        return loss_sum(losses)


def _empty(value: Any, device: torch.device) -> Any:
    """An uninitialised full tensor shaped as ``value`` (a DTensor's global shape), to receive into."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device=device)


def _local(value: Any) -> Any:
    """A DTensor's local shard (FSDP2's rows of this rank), else the value itself."""
    return value.to_local() if hasattr(value, "to_local") else value


def _rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a full tensor cut over ``world`` ranks as FSDP2 cuts dim 0 (``torch.chunk``; the last
    ranks' may be empty)."""
    size = -(-tensor.shape[0] // world)
    start = min(rank * size, tensor.shape[0])
    return tensor[start : min(start + size, tensor.shape[0])]
