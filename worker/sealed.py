"""Checkpoints read as data: nothing in a checkpoint directory, and nothing a rank sends while one is saved or loaded,
runs code in a worker.

Torch's distributed checkpoint (DCP) keeps its ``.metadata`` as a pickle, loads non-tensor items with
``torch.load(weights_only=False)``, and moves its save and load plans between ranks as pickles (``gather_object``,
``scatter_object_list``, ``broadcast_object_list``). pliant reads them all through an allowlist:

- :class:`SealedReader` reads ``.metadata`` only when its SHA-256 is the one the commit marker sealed
  (:mod:`pliant.security.seal`), and unpickles it with :class:`DataUnpickler`;
- :class:`DataLoadPlanner` loads non-tensor items with ``torch.load(weights_only=True)`` (tensors, numbers, strings,
  and lists, tuples and dicts of them); tensor shards are DCP's own ``weights_only`` loads;
- :func:`restrict_objects` makes every object a rank receives over a checkpoint manager's process group go through
  :class:`DataUnpickler` (torch's ``distributed_c10d._tensor_to_object`` is wrapped for those groups only; other
  groups, the script's own object collectives included, are untouched).

:class:`DataUnpickler` builds only DCP's dataclasses and enums, DCP's and Python's exceptions (a rank's failure
reaches rank 0 as one), ``traceback`` summaries, ``torch.Size``, torch's dtypes, layouts (by name) and memory
formats, POSIX paths, and Python's plain containers: no callable that does more than set fields.

**Bounded, whoever sealed it.** A seal says who wrote a checkpoint, not that its writer meant well (every worker holds
the job's checkpoint key), so what reading one may allocate is bounded by what was read: ``.metadata`` of at most
:data:`MAX_METADATA_BYTES`; the containers and byte strings that unpickling builds by calling a constructor
(``bytearray(n)``, ``list(range(n))``, ``torch.Size(range(n))``) at most :data:`ELEMENTS_PER_BYTE` elements for each
byte of the pickle (and :data:`MIN_ELEMENTS` for a small one); and every storage range the metadata names must lie
inside a file of the checkpoint's own directory, since DCP allocates a range's length before it reads it.
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
MAX_METADATA_BYTES = 256 * 2**20
"""The largest ``.metadata`` read (DCP's metadata of a large sharded model is a few MB)."""
ELEMENTS_PER_BYTE = 8
"""What the constructors one unpickling calls may build, in items or bytes, for each byte of the pickle."""
MIN_ELEMENTS = 2**20
"""... and at least this many: a small pickle may still carry a few ordinary containers."""
_SIZED = {"bytes", "bytearray", "list", "tuple", "set", "frozenset", "dict"}  # constructors that allocate by argument
_PLAIN = {"set", "frozenset", "slice", "range", "complex", "bytearray", "list", "dict", "tuple", "int", "float"}
_PLAIN |= {"str", "bytes", "bool"}
_DCP = "torch.distributed.checkpoint"
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class DataUnpickler(pickle.Unpickler):
    """An unpickler that builds data only (see the module docstring for what it admits), and no more of it than
    ``budget`` elements through constructor calls.

    Args:
        file: the pickle.
        budget: the items and bytes its constructor calls (``bytearray(n)``, ``list(...)``, ``torch.Size(...)``) may
            build in all.
    """

    def __init__(self, file: io.BytesIO, budget: int) -> None:
        super().__init__(file)
        self.budget = budget

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not data that a checkpoint may hold; refused")
        if found in _SIZED_TYPES:
            return self._bounded(found)
        return found

    def _bounded(self, make: Any) -> Any:
        """``make`` (a constructor that allocates by its argument), charging what it builds to the budget first."""

        def build(*args: Any) -> Any:
            for arg in args:
                if isinstance(arg, int) and not isinstance(arg, bool):
                    size = arg if make in (bytes, bytearray) else 0
                else:
                    try:
                        size = len(arg)
                    except (TypeError, OverflowError):
                        size = 0 if not isinstance(arg, range) else self.budget + 1
                self.budget -= max(0, size)
                if self.budget < 0:
                    raise pickle.UnpicklingError(
                        f"{make.__name__}() of {size} elements goes past what this pickle may build; refused"
                    )
            return make(*args)

        return build


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


_SIZED_TYPES = frozenset({*(getattr(builtins, name) for name in _SIZED), torch.Size})


def loads(data: bytes) -> Any:
    """Unpickle ``data`` with :class:`DataUnpickler`, its constructors bounded by its size."""
    return DataUnpickler(io.BytesIO(data), max(MIN_ELEMENTS, ELEMENTS_PER_BYTE * len(data))).load()


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
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise WorkerError(
                    f"{path} holds {size} bytes, more than checkpoint metadata may ({MAX_METADATA_BYTES}); it was "
                    f"not used"
                )
            data = f.read(MAX_METADATA_BYTES + 1)
        if self.digest and hashlib.sha256(data).hexdigest() != self.digest:
            raise WorkerError(f"{path} is not the metadata its sealed commit marker names (altered or replaced)")
        try:
            metadata = loads(data)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise WorkerError(f"{path} is not checkpoint metadata ({exc}); it was not used") from None
        if not isinstance(metadata, Metadata):
            raise WorkerError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata; it was not used")
        _check_ranges(metadata, str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_ranges(metadata: Metadata, directory: str) -> None:
    """Every storage range ``metadata`` names lies inside a file of ``directory`` (DCP reads, and allocates, a
    range's length as the metadata says).

    Raises:
        WorkerError: one does not (its file, offset or length).
    """
    sizes: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise WorkerError(f"the metadata in {directory} names its storage as a {type(storage).__name__}; not used")
    for info in storage.values():
        name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
            raise WorkerError(f"the metadata in {directory} names storage file {str(name)[:100]!r}; not used")
        if name not in sizes:
            try:
                sizes[name] = os.stat(os.path.join(directory, name)).st_size
            except OSError:
                raise WorkerError(f"the metadata in {directory} names {name!r}, which is not there; not used") from None
        whole = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length))
        if not whole or offset + length > sizes[name]:  # type: ignore[operator]
            raise WorkerError(
                f"the metadata in {directory} names bytes {offset}+{length} of {name!r}, which holds {sizes[name]}; "
                f"not used"
            )


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
