"""One FSDP2 engine re-formed in place with its ranks renumbered (tests/integration/test_fsdp_reform.py): every
process meets a gloo world, trains a step, gathers the full state (``before_move``), then meets a second world of the
same size in which process p is rank ``perm[p]``, shards the model again (``rewrap``) and loads rank 0's state
(``sync_state``). Each process writes, as JSON: its full state before and after, whether its local rows are the
ones its new rank owns, and whether the module object the script built is still the model: the same object as
``engine.module`` with the same sub-modules, its ``state_dict()`` the full state, its output that of an unsharded
copy of that state, a forward hook registered before the re-form still called, and a training step through it.

Usage: ``python fsdp_reform_job.py PERM OUT [OUTPUTS]``, PERM as ``1,2,0``; OUTPUTS: the last layer's (1: its rows are
uneven over any world > 1).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from pliant.net import free_port
from pliant.worker.fsdp import FSDPEngine, _rows
from pliant.worker.fsdp_release import StaleParameterError
from pliant.worker.inplace.groups import retire_groups


def _model(outputs: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, outputs)
    )  # 32 rows: uneven over 3 ranks (11, 11, 10)


def _full(engine: FSDPEngine) -> dict[str, list]:
    """The full model and optimizer state (collective), as lists of floats by name."""
    options = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(engine.model, options=options)
    optim = get_optimizer_state_dict(engine.model, engine.optimizer, options=options)["state"]
    out = {name: value.flatten().tolist() for name, value in model.items()}
    out.update(
        {
            f"{name}.{key}": value.flatten().tolist()
            for name, state in optim.items()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        }
    )
    return out


def _refused(kept: torch.optim.Optimizer) -> bool:
    """Whether an optimizer built over the parameters of the old world refuses to step, naming a parameter."""
    try:
        kept.step()
    except StaleParameterError as exc:
        return "parameter '" in str(exc) and "model.parameters()" in str(exc)
    return False


def _hook_counts(model: torch.nn.Module) -> list[list[int]]:
    """How many forward and state-dict hooks each module of ``model`` has."""
    names = (
        "_forward_pre_hooks",
        "_forward_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    )
    return [[len(getattr(module, name)) for name in names] for module in model.modules()]


def _live(
    model: torch.nn.Module, engine: FSDPEngine, head: torch.nn.Module, calls: list[int], full: dict[str, torch.Tensor]
) -> dict[str, bool]:
    """Whether the script's own module object is the live model after the re-form (collective: every rank calls)."""
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    plain = _model(head.out_features)
    plain.load_state_dict({k: full[k].view(v.shape) for k, v in plain.state_dict().items()})
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    before = len(calls)
    output = model(x)
    hooked = len(calls) == before + 1
    output.sum().backward()
    engine.optimizer.step()
    return {
        "same_object": engine.module is model and engine.model is model and model[4] is head,
        "state_dict": set(state) == set(plain.state_dict())
        and all(torch.equal(state[k], full[k].view(v.shape)) for k, v in state.items()),
        "forward": bool(torch.allclose(output, plain(x), atol=1e-6)),
        "hook": hooked,
        "trained": not any(torch.equal(p.full_tensor(), full[n].view(p.shape)) for n, p in model.named_parameters()),
    }


def run(process: int, ports: tuple[int, int], perm: list[int], out: str, outputs: int) -> None:
    world = len(perm)
    torch.manual_seed(0)
    model = _model(outputs)
    head, calls = model[4], []
    model.register_forward_hook(lambda module, args, output: calls.append(output.shape[0]))
    store = dist.TCPStore("127.0.0.1", ports[0], world, is_master=process == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=process, world_size=world)
    engine = FSDPEngine(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.device("cpu"))
    torch.manual_seed(process)
    engine.model(torch.randn(4, 16)).sum().backward()  # FSDP2 averages the gradients: the same step everywhere
    engine.optimizer.step()
    hooks = _hook_counts(model)  # after a forward: FSDP2 registers its state-dict hooks then
    kept = torch.optim.SGD(model.parameters(), lr=0.1)  # the script's own, over the parameters of this world
    before = _full(engine)
    engine.before_move()
    retire_groups()
    rank = perm[process]
    store = dist.TCPStore("127.0.0.1", ports[1], world, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    engine.rewrap()
    error = ""
    try:
        engine.sync_state(0)
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    after = _full(engine) if not error else {}
    full = {name: torch.tensor(values) for name, values in after.items()}
    params = dict(engine.model.named_parameters())
    rows_ok = not error and all(
        torch.equal(param.to_local().flatten(), _rows(full[name].view(param.shape), rank, world).flatten())
        for name, param in params.items()
    )
    coordinates = sorted({tuple(p.device_mesh.get_coordinate() or ()) for p in params.values()})
    live = _live(model, engine, head, calls, full) if not error else {}
    live["hooks_once"] = _hook_counts(model) == hooks  # FSDP2's hooks of the old world are gone, the new ones there
    live["stale_refused"] = _refused(kept)
    Path(out, f"process-{process}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "before": before,
                "after": after,
                "error": error,
                "rows_ok": rows_ok,
                "coordinates": coordinates,
                "live": live,
            }
        )
    )
    retire_groups()


if __name__ == "__main__":
    perm = [int(r) for r in sys.argv[1].split(",")]
    outputs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    mp.spawn(run, args=((free_port(), free_port()), perm, sys.argv[2], outputs), nprocs=len(perm))
