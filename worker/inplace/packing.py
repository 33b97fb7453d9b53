"""A shard's tensors packed into one reusable byte buffer, and back: how buddy snapshots
(:mod:`pliant.worker.inplace.buddy`) copy a rank's state to host memory, on a thread while the training computes.

Every tensor starts at a multiple of :data:`ALIGN` bytes (any dtype can view it), and the padding is written too, so
two packs of the same tensors are the same bytes whatever the buffer held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pliant.worker.background import in_background

__all__ = ["ALIGN", "pack", "pack_later", "packed_size", "spans", "unpack"]

ALIGN = 16  # every tensor starts at a multiple of this many bytes in a packed buffer (any dtype can view it)


def spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(offset, bytes) of each tensor in the packed buffer."""
    out, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append((offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return out


def packed_size(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the buffer :func:`pack` fills for ``tensors``."""
    laid = spans(tensors)
    return -(-(laid[-1][0] + laid[-1][1]) // ALIGN) * ALIGN if laid else 0


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``tensors`` into one byte buffer (``out`` when it has the right size, else a new one; pinned when the
    tensors are on CUDA) and wait for the copy."""
    out, wait = pack_later(tensors, out)
    wait()
    return out


def pack_later(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    then: Callable[[torch.Tensor], object] | None = None,
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Start :func:`pack` without waiting: returns the buffer and a function that waits for the copy and for
    ``then(buffer)``, which a thread runs as soon as the copy is done, and raises what failed. On CUDA the copies are
    non-blocking, on the caller's stream, and the thread waits for an event after them; on CPU the thread copies
    (torch releases the GIL). Nothing may write ``tensors`` until the wait returns."""
    size = packed_size(tensors)
    cuda = any(t.is_cuda for t in tensors)
    if out is None or out.numel() != size:
        out = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    buffer = out

    def copy() -> None:
        laid = spans(tensors)
        ends = [offset for offset, _n in laid[1:]] + [size][: len(laid)]
        for t, (offset, n), end in zip(tensors, laid, ends, strict=True):
            buffer[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=cuda)
            buffer[offset + n : end].zero_()  # the alignment padding: the same bytes in every copy

    if cuda:
        copy()
        event = torch.cuda.Event()
        event.record()
        copy = event.synchronize

    def run() -> None:
        copy()
        if then is not None:
            then(buffer)

    return out, in_background(run, "pliant-snapshot").result


def unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a :func:`pack`-ed buffer back into ``tensors`` (the same shapes and dtypes, in the same order)."""
    with torch.no_grad():
        for t, (offset, n) in zip(tensors, spans(tensors), strict=True):
            t.copy_(buffer[offset : offset + n].view(t.dtype).view(t.shape))
