"""Taking FSDP2 back off a module tree, in place, so that the same module objects can be sharded over another world.

FSDP2's ``fully_shard`` works on the user's module objects: it swaps each managed parameter for a sharded DTensor
parameter on the world's device mesh, gives each sharded module a subclass of its class (``FSDP<Class>``), registers
forward and state-dict hooks (which act on that world's shards) and records its state on the module (the
composable-API registry) and in torch's module-state map. A
sharded module cannot move to another mesh, and ``fully_shard`` refuses a module it was applied to. :func:`release`
undoes exactly those marks on every module of a tree, and leaves each managed parameter a plain full-size parameter
(uninitialised: the caller loads the state), so ``fully_shard`` applies again to the very objects the script holds:
``model``, its sub-modules, the hooks the script registered and the parameters' sharing (tied weights stay tied) all
carry over. Parameter objects do not: each is a new one.

The marks are torch internals (checked on torch 2.11 and 2.13; ``torch.distributed.fsdp.fully_shard`` is public
from 2.6): ``torch.distributed._composable.contract``'s ``STATE_KEY`` / ``REGISTRY_KEY`` in a module's ``__dict__``,
``torch.distributed._composable_state._module_state_mapping``, and its hooks told apart by the module that defines
them (``torch.distributed.fsdp``). Where a
torch keeps them elsewhere, :func:`unsupported` says so, and the engine takes the restart path at every rescale
instead (tests/integration/test_fsdp_reform.py releases and shards again on every run).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from pliant.worker.contract import EngineError

__all__ = ["ReleaseError", "release", "unsupported"]


class ReleaseError(EngineError):
    """FSDP2's marks on a module are not where this torch version was expected to keep them."""


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
    ``requires_grad``; a parameter shared by several modules stays shared. Buffers are left as they are.

    Raises:
        ReleaseError: this torch keeps FSDP2's marks elsewhere.
    """
    state_key, registry_key, mapping, fsdp_state_cls = _internals()
    from torch.distributed.fsdp import FSDPModule

    fresh: dict[int, nn.Parameter] = {}
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
            module._parameters[name] = fresh[id(param)]


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
