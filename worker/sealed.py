"""Checkpoints read as data: nothing in a checkpoint directory, and nothing a rank sends while one is saved or loaded,
runs code in a worker.

Torch's distributed checkpoint (DCP) keeps its ``.metadata`` as a pickle, loads non-tensor items with
``torch.load(weights_only=False)``, and moves its save and load plans between ranks as pickles (``gather_object``,
``scatter_object_list``, ``broadcast_object_list``). pliant reads them all through an allowlist:

- :class:`SealedReader` reads ``.metadata`` only when its SHA-256 is the one the commit marker sealed
  (:mod:`pliant.seal`), and unpickles it with :class:`DataUnpickler`;
- :class:`DataLoadPlanner` loads non-tensor items with ``torch.load(weights_only=True)`` (tensors, numbers, strings,
  and lists, tuples and dicts of them); tensor shards are DCP's own ``weights_only`` loads;
- :func:`restrict_objects` makes every object a rank receives over a checkpoint manager's process group go through
  :class:`DataUnpickler` (torch's ``distributed_c10d._tensor_to_object`` is wrapped for those groups only; other
  groups, the script's own object collectives included, are untouched).

:class:`DataUnpickler` builds only DCP's dataclasses and enums, DCP's and Python's exceptions (a rank's failure
reaches rank 0 as one), ``traceback`` summaries, ``torch.Size``, torch's dtypes, layouts (by name) and memory
formats, POSIX paths, and Python's plain containers: no callable that does more than set fields.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import enum
import hashlib
import importlib
import io
import logging
import os
import pathlib
import pickle
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from pliant.worker.contract import WorkerError

__all__ = ["DataLoadPlanner", "DataUnpickler", "SealedReader", "metadata_digest", "restrict_objects", "unrestrict"]

logger = logging.getLogger(__name__)

METADATA = ".metadata"
_PLAIN = {"set", "frozenset", "slice", "range", "complex", "bytearray", "list", "dict", "tuple", "int", "float"}
_PLAIN |= {"str", "bytes", "bool"}
_DCP = "torch.distributed.checkpoint"
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class DataUnpickler(pickle.Unpickler):
    """An unpickler that builds data only (see the module docstring for what it admits)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not data that a checkpoint may hold; refused")
        return found


def _allowed(module: str, name: str) -> Any:
    if module == "builtins":
        value = getattr(builtins, name, None)
        if name in _PLAIN or (isinstance(value, type) and issubclass(value, BaseException)):
            return value
        return None
    if module == "collections" and name in ("OrderedDict", "defaultdict"):
        return getattr(collections, name)
    if module == "traceback" and name in ("StackSummary", "FrameSummary"):
        return getattr(traceback, name)
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # DCP's write results name files by path
        return getattr(pathlib, name)
    if module == "torch.serialization" and name == "_get_layout":  # a layout by its name: a dictionary lookup
        return torch.serialization._get_layout
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, _TORCH_VALUES) else None
    if module == _DCP or module.startswith(_DCP + "."):
        try:
            value = getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
        if isinstance(value, type) and (
            dataclasses.is_dataclass(value) or issubclass(value, (enum.Enum, BaseException))
        ):
            return value
    return None


def loads(data: bytes) -> Any:
    """Unpickle ``data`` with :class:`DataUnpickler`."""
    return DataUnpickler(io.BytesIO(data)).load()


def metadata_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of the ``.metadata`` file of the checkpoint at ``path``."""
    with open(os.path.join(path, METADATA), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class SealedReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` must have the SHA-256 ``digest`` (the sealed marker's; "" checks
    nothing: an unsealed checkpoint outside an agent) and is unpickled as data."""

    def __init__(self, path: str | os.PathLike[str], digest: str = "") -> None:
        super().__init__(path)
        self.digest = digest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), METADATA)
        with open(path, "rb") as f:
            data = f.read()
        if self.digest and hashlib.sha256(data).hexdigest() != self.digest:
            raise WorkerError(f"{path} is not the metadata its sealed commit marker names (altered or replaced)")
        try:
            metadata = loads(data)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise WorkerError(f"{path} is not checkpoint metadata ({exc}); it was not used") from None
        if not isinstance(metadata, Metadata):
            raise WorkerError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata; it was not used")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor items loaded as data (``torch.load(weights_only=True)``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            what = read_item.dest_index.fqn
            raise WorkerError(f"checkpoint item {what} is not data ({str(exc)[:200]}); it was not loaded") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_restricted: list[Any] = []  # process groups whose received objects DataUnpickler builds


def restrict_objects(group: Any) -> None:
    """Unpickle every object received over ``group`` with :class:`DataUnpickler` (see the module docstring)."""
    _install()
    if not any(g is group for g in _restricted):
        _restricted.append(group)


def unrestrict(group: Any) -> None:
    """Forget ``group`` (it was replaced)."""
    _restricted[:] = [g for g in _restricted if g is not group]


def _install() -> None:
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_tensor_to_object", None)
    if original is None:
        logger.warning("torch has no distributed_c10d._tensor_to_object: pliant cannot restrict what DCP unpickles")
        return
    if getattr(original, "pliant_restricted", False):
        return

    def _tensor_to_object(tensor: torch.Tensor, tensor_size: int, group: Any) -> Any:
        if group is not None and any(g is group for g in _restricted):
            return loads(tensor.cpu().numpy().tobytes()[:tensor_size])
        return original(tensor, tensor_size, group)

    _tensor_to_object.pliant_restricted = True  # type: ignore[attr-defined]
    c10d._tensor_to_object = _tensor_to_object
