"""Taking FSDP2 back off a module tree, in place, so that the same module objects can be sharded over another world.

FSDP2's ``fully_shard`` works on the user's module objects: it swaps each managed parameter for a sharded DTensor
parameter on the world's device mesh, gives each sharded module a subclass of its class (``FSDP<Class>``), registers
forward and state-dict hooks (which act on that world's shards) and records its state on the module (the
composable-API registry) and in torch's module-state map. A sharded module cannot move to another mesh, and
``fully_shard`` refuses a module it was applied to. :func:`release` undoes exactly those marks on every module of a
tree, and leaves each managed parameter a plain full-size parameter (uninitialised: the caller loads the state), so
``fully_shard`` applies again to the very objects the script holds: ``model``, its sub-modules, the hooks the script
registered and the parameters' sharing (tied weights stay tied) all carry over. Parameter objects do not: each is a
new one, and the old ones are *retired*: any torch operation on one (an optimizer the script built itself, a
reference kept from before, ``p.full_tensor()``) raises :class:`StaleParameterError` naming the parameter and what to
use instead, never a stale value.

The marks are torch internals (checked on torch 2.11 and 2.13; ``torch.distributed.fsdp.fully_shard`` is public
from 2.6): ``torch.distributed._composable.contract``'s ``STATE_KEY`` / ``REGISTRY_KEY`` in a module's ``__dict__``,
``torch.distributed._composable_state._module_state_mapping``, and its hooks, told apart by the module that defines
them (``torch.distributed.fsdp``). Where a torch keeps them elsewhere, :func:`unsupported` says so, and the engine
takes the restart path at every rescale instead (tests/integration/test_fsdp_reform.py releases and shards again on
every run).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from pliant.worker.contract import EngineError

__all__ = ["ReleaseError", "StaleParameterError", "release", "unsupported"]


class ReleaseError(EngineError):
    """FSDP2's marks on a module are not where this torch version was expected to keep them."""


class StaleParameterError(EngineError):
    """A parameter object from before an in-place re-form was used: the model's parameters are new objects since."""


def _internals() -> tuple[str, str, Any, type]:
    """(STATE_KEY, REGISTRY_KEY, the module-state map, FSDPState) of this torch, or ReleaseError."""
    try:
        contract = importlib.import_module("torch.distributed._composable.contract")
        composable_state = importlib.import_module("torch.distributed._composable_state")
        fsdp_state = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_state")
        return (
            contract.STATE_KEY,
            contract.REGISTRY_KEY,
            composable_state._module_state_mapping,
            fsdp_state.FSDPState,
        )
    except (ImportError, AttributeError) as exc:
        raise ReleaseError(
            f"torch {torch.__version__} keeps FSDP2's state elsewhere ({exc}): the fsdp engine cannot shard the "
            f"script's module again over a new world, so every rescale takes the restart path (checkpoint and "
            f"resume; pass --checkpoint-dir to keep progress)"
        ) from exc


def unsupported() -> str:
    """Why this torch's FSDP2 cannot be released (one line for the user), or "" when it can."""
    try:
        _internals()
    except ReleaseError as exc:
        return str(exc)
    return ""


def release(root: nn.Module, device: torch.device) -> None:
    """Take ``fully_shard`` off every module of ``root``'s tree, in place (see the module docstring).

    Each parameter becomes a plain ``nn.Parameter`` of its full (global) shape on ``device``, uninitialised, with its
    ``requires_grad``; a parameter shared by several modules stays shared. Buffers are left as they are. The old
    parameter objects are retired (:func:`_retire`).

    Raises:
        ReleaseError: this torch keeps FSDP2's marks elsewhere.
    """
    state_key, registry_key, mapping, fsdp_state_cls = _internals()
    from torch.distributed.fsdp import FSDPModule

    fresh: dict[int, nn.Parameter] = {}
    names = {id(param): name for name, param in root.named_parameters(remove_duplicate=False)}
    for module in root.modules():
        states = module.__dict__.get(state_key) or {}
        for key, state in list(states.items()):
            if not isinstance(state, fsdp_state_cls):
                continue
            del states[key]
            (module.__dict__.get(registry_key) or {}).pop("fully_shard", None)
        _remove_hooks(module)
        mapping.pop(module, None)
        if isinstance(module, FSDPModule):
            module.__class__ = next(base for base in type(module).__bases__ if base is not FSDPModule)
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(attr, None)
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in fresh:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                fresh[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
                _retire(param, names.get(id(param), name))
            module._parameters[name] = fresh[id(param)]


_STALE: dict[type, type] = {}  # a parameter class -> its retired twin, whose every torch operation raises


def _retire(param: torch.Tensor, name: str) -> None:
    """Make every later torch operation on ``param`` (an old FSDP2 parameter) raise :class:`StaleParameterError`: its
    class becomes a twin whose ``__torch_function__`` refuses. A class that cannot be swapped is left as it is."""
    cls = type(param)
    if cls not in _STALE:
        _STALE[cls] = type(f"Retired{cls.__name__}", (cls,), {"__torch_function__": classmethod(_refuse)})
    try:
        param.__dict__["_pliant_name"] = name
        param.__class__ = _STALE[cls]
    except (TypeError, AttributeError):
        return


def _refuse(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """The retired twin's ``__torch_function__``."""
    stale = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls)), None)
    if stale is None:  # a list of parameters (a foreach optimizer step): name the first retired one in it
        flat = [x for a in args if isinstance(a, (list, tuple)) for x in a]
        stale = next((x for x in flat if isinstance(x, cls)), None)
    name = stale.__dict__.get("_pliant_name", "?") if stale is not None else "?"
    raise StaleParameterError(
        f"parameter {name!r} is one the model had before pliant sharded it again for a new world, and not the "
        f"model's any more ({getattr(func, '__name__', func)} on it): take the parameters from model.parameters() "
        f"again after a rescale, and build optimizers through session.engine (engine.optimizer is rebuilt)"
    )


# A module's hook dictionaries, and the dictionaries keyed by the same handle ids that say how each hook is called.
_HOOKS = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_state_dict_pre_hooks": (),
    "_state_dict_hooks": (),
    "_load_state_dict_pre_hooks": (),
    "_load_state_dict_post_hooks": (),
}


def _fsdp_hook(hook: Any) -> bool:
    """Whether a module hook is FSDP2's (defined in ``torch.distributed.fsdp``, possibly wrapped)."""
    fn = getattr(hook, "hook", hook)  # a load-state-dict pre-hook is kept wrapped
    fn = getattr(fn, "__func__", fn)  # a bound method of an FSDP state
    return str(getattr(fn, "__module__", "")).startswith("torch.distributed.fsdp")


def _remove_hooks(module: nn.Module) -> None:
    """Remove the hooks FSDP2 registered on ``module`` (forward, state-dict save and load), and only those."""
    for name, companions in _HOOKS.items():
        hooks = module.__dict__.get(name)
        if not hooks:
            continue
        for key in [key for key, hook in hooks.items() if _fsdp_hook(hook)]:
            del hooks[key]
            for companion in companions:
                extra = module.__dict__.get(companion)
                if isinstance(extra, dict):
                    extra.pop(key, None)
                elif extra is not None:
                    extra.discard(key)
