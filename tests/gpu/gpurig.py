"""What the GPU tests share: where they run, the KV caches vLLM 0.33 hands a connector, and
an independent statement of the chunk byte order.

`Backend` is a test's device: "cuda" (a real GPU: `CudaDevice`, CUDA tensors; skipped where
torch sees none) or "standin" (kvtier/testing/standin.py: CPU tensors copied with the
accelerators' torch index ops, streams as threads that run their work late). Every test body
takes one, so CI runs the very code that scripts/gpu-check.sh runs on a GPU.

`CASES` are vLLM 0.33's KV caches by its own allocation rules (kvtier/testing/vllmviews.py):
the layer-outermost and block-outermost layouts, MLA's 4-D `[B, 1, N, latent]` views, a
manager block split into r=4 kernel blocks, bf16 and fp8 (uint8 tensors). Their format comes
from `kvformat.attention_format`, as the connector reads it from vLLM's spec.

`reference_chunk` builds a chunk's bytes from the logical views with plain tensor ops, not
through `PagedKV`: the chunk order `[L, blocks, H, K/V, block_size, D]` (paged.py) that CPU and
CUDA engines share.

No vLLM is imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.kvformat import AttentionFormat, attention_format
from kvtier.integrations.vllm.worker.device import CudaDevice, Device, Event
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.standin import StandInDevice
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
BACKENDS = [pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA]), "standin"]
BS = 16  # vLLM's block size in the tests
SLEEP_CYCLES_PER_S = 2e9  # torch.cuda._sleep counts clock cycles; GPUs clock <= 2 GHz


@dataclass(frozen=True, slots=True)
class Case:
    """One of vLLM 0.33's KV caches."""

    name: str
    layout: str  # vllmviews.LAYOUTS
    dtype: torch.dtype  # the tensors' (uint8 for fp8)
    cache_dtype: str  # vLLM's --kv-cache-dtype
    heads: int
    head_size: int
    mla: bool = False  # head_size_v 0: one latent a token
    kernel_block_size: int | None = None  # vLLM's kernel blocks; None: the block size

    def spec(self) -> VllmCacheSpec:
        return VllmCacheSpec(BS, self.heads, self.head_size, 0 if self.mla else self.head_size,
                             self.dtype)

    def format(self) -> AttentionFormat:
        return attention_format(self.spec(), f"test {self.name}", self.cache_dtype)


def _cases() -> list[Case]:
    bf16, fp8 = (torch.bfloat16, "auto"), (torch.uint8, "fp8")
    return [
        *(Case(f"{layout}-bf16", layout, *bf16, heads=2, head_size=8)
          for layout in ("LBNHC", "LBHNC", "BLHNC", "LHBNC", "BLNHC", "BHLNC")),
        Case("LBNHC-fp8", "LBNHC", *fp8, heads=2, head_size=8),
        Case("BLHNC-fp8", "BLHNC", *fp8, heads=2, head_size=8),
        Case("MLA-bf16", "LBNHC", *bf16, heads=1, head_size=24, mla=True),
        Case("MLA-fp8", "LBNHC", *fp8, heads=1, head_size=24, mla=True),
        Case("split4-LBNHC-bf16", "LBNHC", *bf16, heads=2, head_size=8,
             kernel_block_size=BS // 4),
        Case("split4-LBNHC-fp8", "LBNHC", *fp8, heads=2, head_size=8,
             kernel_block_size=BS // 4),
        Case("split4-MLA-bf16", "LBNHC", *bf16, heads=1, head_size=24, mla=True,
             kernel_block_size=BS // 4),
    ]


CASES = _cases()
CASE_IDS = [c.name for c in CASES]


class Backend:
    """A test's device: the `Device` the mover orders its work through, where tensors live,
    and the test's model of vLLM's forward on the compute stream."""

    def __init__(self, name: str, device: Device | None = None) -> None:
        self.name = name
        self.cuda = name == "cuda"
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
            else torch.device("cpu")
        self.device: Any = device or (CudaDevice(self.torch_device) if self.cuda
                                      else StandInDevice(max_delay_s=0.0005))
        self.pin = "on" if self.cuda else "off"  # the memory tier's slab

    def kv_caches(self, case: Case, num_layers: int, num_blocks: int) -> dict[str, torch.Tensor]:
        """vLLM 0.33's per-layer views of one allocation of random bytes, on this device."""
        return vllm_kv_caches(case.spec(), num_layers, num_blocks, case.layout,
                              device=self.torch_device, kernel_block_size=case.kernel_block_size)

    def paged(self, case: Case, kv: dict[str, torch.Tensor]) -> PagedKV:
        """`kv` as the connector sees it (the accelerators' content and torch index ops)."""
        return PagedKV(kv, BS, case.format(), content="latent" if case.mla else "halves",
                       torch_ops=True)

    def forward(self, work: Callable[[], Any]) -> None:
        """Queue `work` (tensor ops) on the compute stream, as vLLM's forward is."""
        if self.cuda:
            work()  # the kernels go to the current stream; the host goes on
        else:
            self.device.forward(work)

    def busy(self, seconds: float) -> None:
        """Keep the compute stream busy for about `seconds` (a long forward)."""
        if self.cuda:
            torch.cuda._sleep(int(seconds * SLEEP_CYCLES_PER_S))
        else:
            self.device.forward(lambda: time.sleep(seconds))

    def late_event(self, seconds: float) -> Event:
        """An event reached after about `seconds` of device work on a stream of its own
        (vLLM's queued work a load must come after). Make it after the mover: the stand-in
        names its streams in order of creation."""
        stream = self.device.new_stream()
        if self.cuda:
            self.device.run(stream, lambda: torch.cuda._sleep(int(seconds * SLEEP_CYCLES_PER_S)))
        else:
            self.device.enqueue(stream, lambda: time.sleep(seconds))  # a kernel's time
        event: Event = self.device.new_event()
        self.device.record(event, stream)
        return event

    def drain(self) -> None:
        """Wait until every stream has run its queued work."""
        if self.cuda:
            torch.cuda.synchronize(self.torch_device)
        else:
            self.device.drain()

    def close(self) -> None:
        """Raise what any of the stand-in's streams raised."""
        if not self.cuda:
            self.device.close()


def reference_chunk(kv: dict[str, torch.Tensor], block_ids: tuple[int, ...],
                    case: Case) -> torch.Tensor:
    """The chunk of `block_ids` as uint8, built from vLLM's logical `[B * r, H, N / r, C]`
    views: layers, then blocks in order, then heads, then K before V (one latent for MLA),
    then the block's tokens, then the head dimension."""
    parts = []
    index = torch.tensor(block_ids, device=next(iter(kv.values())).device)
    for layer in kv.values():
        kernel_blocks, heads, n, content = layer.shape
        r = BS // n
        blocks = layer.unflatten(0, (kernel_blocks // r, r)).index_select(0, index)
        tokens = blocks.permute(0, 2, 1, 3, 4).reshape(len(block_ids), heads, BS, content)
        if case.mla:
            parts.append(tokens.unsqueeze(2))
        else:
            d = content // 2
            parts.append(tokens.reshape(len(block_ids), heads, BS, 2, d).permute(0, 1, 3, 2, 4))
    return torch.stack(parts).contiguous().view(-1).view(torch.uint8)
