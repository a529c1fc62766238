"""How the stand-in device (standin.py) splits a piece of queued work as CUDA does: its host
side (Python, index building, allocations, views) runs at `run`, on the caller's thread; its
tensor ops (the kernels and DMAs) are recorded and run later, when the stream gets to them.

A closure run whole and late, as the stand-in's were, read Python state set after `run`
returned and kept the host buffers it named alive, where on a GPU the launches read that
state at `run` and only the device's reads and writes come later. Here, inside `run`, a
torch dispatch mode (`Recorder`, thread-local) sees every aten op of the work:
- views run at once (they only make metadata, as CUDA's do on the host);
- ops that write their arguments (`copy_`, `index_copy_`, `out=`) are queued and return
  those arguments;
- ops that make new tensors get their outputs allocated at once, filled with the poison byte,
  and written when the stream runs the op (what CUDA's caching allocator does);
- an op whose result the host needs (`.item()`, `nonzero`, a data-dependent shape) is a host
  sync, as on CUDA: what was recorded goes to the stream, the caller waits for it, and the op
  runs on the caller's thread (counted: `stalls["sync"]`, a GPU's stall);
- ops with no tensor argument (factories) run at once;
- a `copy_` between device memory and host memory the device did not pin (`pinned`) is
  counted (`stalls["pageable"]`): on a GPU the driver stages it, synchronously.

Host memory is memory torch did not allocate: a buffer's (`torch.frombuffer`: the store's
slots, spares), numpy's (`torch.from_numpy`: index arrays) and the stand-in's `pinned` (its
storage is not resizable); device memory is torch's own (the KV caches, `empty`, outputs).
A GPU's DMA reads or writes host memory when the copy engine gets to it, and nothing keeps
the buffer as it was meanwhile. So at record time each host buffer an op reads is
snapshotted, and each one it writes is snapshotted and, when nothing queued still reads or
writes it, filled with the poison byte (a host read before the copy's event reads poison, not
the stale bytes a GPU might leave); when the stream gets to the op, a snapshot that no longer
matches means the host changed the buffer while the device's access to it was queued (a
spare refilled, a slot reused, a commit's bytes written): `HostBufferRaced`, raised by the
stream (surfaced by `StandInDevice.close`) and the op is not run. A buffer that queued work
writes first is not snapshotted for the ops after it (its bytes are the device's to change).

Primitives: `Recorder`, `DeferredOp`, `HostAccess`, `is_host`, `warm_up`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from kvtier.errors import HostBufferRaced, HostSync

POISON = 0xA5


def is_host(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in host memory (see the module docstring)."""
    return not tensor.untyped_storage().resizable()


def span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses [start, end) of the bytes `tensor` covers (empty: (0, 0))."""
    if tensor.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`'s bytes (contiguous uint8)."""
    return tensor.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


@dataclass(slots=True)
class HostAccess:
    """A host buffer a queued op reads or writes, as it was when the op was recorded."""

    tensor: torch.Tensor
    snapshot: torch.Tensor | None  # None: queued work writes it first (not checked)
    writes: bool

    def check(self, op: str) -> None:
        """Raise HostBufferRaced if the host changed the buffer since the op was recorded."""
        if self.snapshot is not None and not torch.equal(_bytes(self.tensor), self.snapshot):
            raise HostBufferRaced(op, "write" if self.writes else "read",
                                  tuple(self.tensor.shape), self.tensor.dtype)


class Pending(Protocol):
    """Where a device keeps the host spans its queued ops read and write (any thread)."""

    def note(self, spans: list[tuple[int, int]], writes: bool, add: bool) -> None: ...

    def overlaps(self, where: tuple[int, int], writes_only: bool) -> bool: ...

    def is_pinned(self, where: tuple[int, int]) -> bool: ...


@dataclass(slots=True)
class DeferredOp:
    """One recorded aten op: what the stream runs when it gets to it."""

    func: Any  # torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]  # allocated at record time, filled with the op's results
    accesses: list[HostAccess]
    pending: Pending

    def __call__(self) -> None:
        try:
            for access in self.accesses:
                access.check(str(self.func))
            result = self.func(*self.args, **self.kwargs)
            if self.outputs:
                made = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
                for out, value in zip(self.outputs, made):
                    out.copy_(value)
        finally:
            for writes in (False, True):
                self.pending.note([span(a.tensor) for a in self.accesses if a.writes == writes],
                                  writes, add=False)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _poisoned_like(meta: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
    torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage()).fill_(POISON)
    return out


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's, untyped
    """Inside `with Recorder(...)`: the calling thread's aten ops are split as the module
    docstring says. `flush(ops)` queues recorded ops on the stream; `sync()` waits for what
    was flushed (a host sync)."""

    def __init__(self, pending: Pending, flush: Callable[[list[DeferredOp]], None],
                 sync: Callable[[], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._pending = pending
        self._flush = flush
        self._sync = sync
        self.ops: list[DeferredOp] = []
        self.syncs = 0
        self.pageable = 0  # copies between device memory and host memory not pinned

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        if func.is_view or not tensors:
            return func(*args, **kwargs)  # metadata, or an allocation: host side
        written = _written_args(func, args, kwargs)
        try:
            returned, outputs = self._results(func, args, kwargs, written)
        except HostSync:
            self.host_sync()
            return func(*args, **kwargs)
        written_ids = {id(t) for t in written}
        # Only a copy_'s destination is overwritten whole: poisoned when nothing queued
        # touches it (an index_copy_ keeps the bytes it does not write).
        whole = func is torch.ops.aten.copy_.default
        if whole and self._pageable_copy(args[0], args[1]):
            self.pageable += 1
        accesses = [self._access(t, id(t) in written_ids, whole) for t in _unique(tensors)
                    if is_host(t)]
        self.ops.append(DeferredOp(func, args, kwargs, outputs, accesses, self._pending))
        return returned

    def host_sync(self) -> None:
        """Send what was recorded to the stream and wait for the stream to run it."""
        self.syncs += 1
        self.flush()
        self._sync()

    def flush(self) -> None:
        ops, self.ops = self.ops, []
        if ops:
            self._flush(ops)

    @staticmethod
    def _results(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 written: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """(what the op returns now, the outputs the stream fills); HostSync if the host
        needs the op's values (a scalar, or a shape only the data tells)."""
        returns = func._schema.returns
        if written and all(r.alias_info is not None and r.alias_info.is_write for r in returns):
            if not returns:
                return None, []
            return (written[0] if len(returns) == 1 else tuple(written)), []
        try:
            meta = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        except (NotImplementedError, RuntimeError) as error:
            raise HostSync from error
        flat, _ = tree_flatten(meta)
        if not all(isinstance(v, torch.Tensor) for v in flat):
            raise HostSync
        outputs = [_poisoned_like(m) for m in flat]
        made = iter(outputs)
        return tree_map(lambda m: next(made) if isinstance(m, torch.Tensor) else m, meta), \
            outputs

    def _pageable_copy(self, dst: Any, src: Any) -> bool:
        """Whether a copy_ moves bytes between device memory and host memory the device did
        not pin (on a GPU: staged by the driver, synchronously)."""
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            return False
        if is_host(dst) == is_host(src):
            return False
        host = dst if is_host(dst) else src
        return host.numel() > 0 and not self._pending.is_pinned(span(host))

    def _access(self, tensor: torch.Tensor, writes: bool, whole: bool) -> HostAccess:
        """Note a host buffer the op reads or writes; snapshot it (see the module
        docstring), poisoning one it writes when no queued op touches it."""
        where = span(tensor)
        snapshot: torch.Tensor | None = None
        if not self._pending.overlaps(where, writes_only=not writes):
            if writes and whole and tensor.is_contiguous():
                tensor.reshape(-1).view(torch.uint8).fill_(POISON)
            snapshot = _bytes(tensor)
        self._pending.note([where], writes, add=True)
        return HostAccess(tensor, snapshot, writes)


class _NoPending:
    def note(self, spans: list[tuple[int, int]], writes: bool, add: bool) -> None:
        pass

    def overlaps(self, where: tuple[int, int], writes_only: bool) -> bool:
        return False

    def is_pinned(self, where: tuple[int, int]) -> bool:
        return True


@functools.cache
def warm_up() -> None:
    """Record a few ops once a process: the first dispatch mode and meta op import torch's
    meta registrations (~1 s), which would land on a device's first `run` (a benchmark's
    first trial)."""
    x = torch.zeros(4)
    with Recorder(_NoPending(), lambda _ops: None, lambda: None):
        x[:2].view(-1).copy_(x[2:])
        x.index_select(0, torch.zeros(1, dtype=torch.long))


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` without repeats (the same tensor twice in an op is one access)."""
    unique: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        unique.setdefault(id(tensor), tensor)
    return list(unique.values())


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors the op writes (its schema's `Tensor(a!)` arguments), in schema order."""
    written: list[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, torch.Tensor)]
    return written
