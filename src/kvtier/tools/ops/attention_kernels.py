"""The KV block sizes vLLM's CUDA attention kernels take, and what vLLM 0.33 does with a
`--block-size` a kernel does not take as it is.

vLLM's KV cache manager hands out blocks of `--block-size` tokens; the attention backend
reads them as "kernel blocks". Each backend declares the kernel block sizes it takes
(`get_supported_kernel_block_sizes`): exact sizes, or any multiple of a base. vLLM 0.33:

- a block size that no declared size divides rules the backend out
  (`AttentionBackend.supports_block_size`, vllm/v1/attention/backend.py): vLLM picks the
  next backend in its priority order (`_get_backend_priorities`, vllm/platforms/cuda.py) and
  logs "--block-size N precluded higher-priority backend(s)", or, when no backend is left or
  the operator named the backend, refuses to start;
- a block the backend does not take as it is, but that a declared exact size divides, is
  split into kernel blocks of the largest such size (`select_common_block_size`,
  `prepare_kernel_block_sizes`, vllm/v1/worker/utils.py);
- without `--block-size` vLLM uses 16, or the smallest size the backend takes when it does
  not take 16 (`get_preferred_block_size`), so the default is never split;
- a block-outermost physical layout (VLLM_KV_CACHE_LAYOUT=BLHNC, BLNHC or BHLNC) puts the
  other layers' pages between a block's kernel blocks, so there the split is refused
  (`AttentionGroup.map_kv_cache_to_kernel_blocks`, vllm/v1/worker/utils.py, and
  `create_kv_cache_views`, vllm/v1/kv_cache_interface.py).

Primitives:
    KernelBlocks, CUDA_BACKENDS   -- the table: backend name -> the kernel blocks it takes
    BackendChoice, choose_backend(sm_major, mla, kv_dtype, block_size, named)
                                  -- the backend vLLM picks, and the kernel block it uses
                                     (a backend runs only the `--kv-cache-dtype` values it
                                     declares: packed ones are not FP8's)
    default_block_size(...)       -- vLLM's block size when `--block-size` is not given
    long_context_block(...)       -- a larger block for long contexts that keeps the kernel
    describe_choice(choice)       -- one line for `kvtier plan`
    BLOCK_OUTERMOST_LAYOUTS       -- VLLM_KV_CACHE_LAYOUT values where vLLM cannot split
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tools.ops.kvdtypes import serve_flag_value

DEFAULT_BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE (vllm/config/cache.py)
# KVCacheLayout members whose B (block) axis is outermost (vllm/v1/kv_cache_layout.py).
BLOCK_OUTERMOST_LAYOUTS = frozenset({"BLHNC", "BLNHC", "BHLNC"})
_ALL_SM = (8, 9, 10, 12)
_FP8 = ("fp8", "fp8_e4m3")  # per-tensor FP8 (FlashAttention refuses fp8_e5m2: fa_utils.py)
_FP8_ANY = (*_FP8, "fp8_e5m2")
_PER_TOKEN_HEAD = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head")
_TURBOQUANT = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
               "turboquant_3bit_nc")


@dataclass(frozen=True, slots=True)
class KernelBlocks:
    """One CUDA attention backend: the kernel block sizes it takes (vLLM 0.33)."""

    name: str  # AttentionBackendEnum name, as `--attention-backend` takes it
    mla: bool  # serves MLA (DeepSeek-style latent) models; False: standard attention
    sizes: tuple[int, ...] = ()  # exact kernel block sizes it takes
    multiple_of: int = 0  # it also takes any multiple of this as it is (0: none)
    sm: tuple[int, ...] = _ALL_SM  # compute-capability majors it runs on
    fp8_sm: tuple[int, ...] = _ALL_SM  # majors on which it takes an FP8 KV cache
    source: str = ""  # its module under vllm/v1/attention/backends/
    # the quantized `--kv-cache-dtype` values it takes (`supported_kv_cache_dtypes`)
    kv_dtypes: tuple[str, ...] = _FP8
    # it takes a 16-bit cache ("auto"); TurboQuant takes only its own dtypes
    sixteen_bit: bool = True
    # (dtype, majors): a dtype it takes on some GPUs only (FlashInfer's NVFP4)
    dtype_sm: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def takes_dtype(self, kv_dtype: str, sm_major: int) -> bool:
        """It runs a `kv_dtype` cache (vLLM's name; "auto" for 16-bit) on SM `sm_major`."""
        if kv_dtype == "auto":
            return self.sixteen_bit
        if kv_dtype not in self.kv_dtypes:
            return False
        if kv_dtype in _FP8_ANY and sm_major not in self.fp8_sm:
            return False
        return sm_major in dict(self.dtype_sm).get(kv_dtype, _ALL_SM)

    @property
    def bases(self) -> tuple[int, ...]:
        """Every size it declares: the exact ones and the base of its multiples."""
        return self.sizes + ((self.multiple_of,) if self.multiple_of else ())

    def accepts(self, block_size: int) -> bool:
        """vLLM can use this backend with `block_size` (as is, or split)."""
        return any(block_size % base == 0 for base in self.bases)

    def kernel_block(self, block_size: int) -> int | None:
        """The kernel block vLLM uses for `block_size`: itself when taken as is, else the
        largest exact size dividing it (a split); None when not accepted."""
        if block_size in self.sizes or (self.multiple_of and block_size % self.multiple_of == 0):
            return block_size
        divisors = [s for s in self.sizes if block_size % s == 0]
        return max(divisors) if divisors else None

    def preferred_block(self) -> int:
        """vLLM's block size for this backend without `--block-size`."""
        if self.accepts(DEFAULT_BLOCK_SIZE):
            return DEFAULT_BLOCK_SIZE
        return min(self.bases)

    def describe(self) -> str:
        """"16/32/64", "multiples of 16", "64"."""
        parts = ["/".join(map(str, self.sizes))] if self.sizes else []
        if self.multiple_of:
            parts.append(f"multiples of {self.multiple_of}")
        return " or ".join(parts)


# vLLM 0.33.0, `get_supported_kernel_block_sizes` of each backend module (FlashInfer: outside
# SM100; on SM100 with GQA and the trtllm-gen kernels it also takes 128-1024) and
# `supports_compute_capability` / `supported_kv_cache_dtypes` for `sm` / `fp8_sm`.
# FlashAttention takes FP8 KV on Hopper only (FA3; fa_utils.py). The packed dtypes: per-token-
# head int4/int8/fp8 on Triton only, NVFP4 on FlashInfer (its FA2 path on SM80/90/120 takes
# "nvfp4" only; "nvfp4_4over6" needs SM100's trtllm-gen kernels: flashinfer.py
# supports_kv_cache_dtype), TurboQuant's on its own backend, which takes nothing else.
CUDA_BACKENDS: dict[str, KernelBlocks] = {k.name: k for k in (
    KernelBlocks("FLASH_ATTN", False, multiple_of=16, fp8_sm=(9,), source="flash_attn.py"),
    KernelBlocks("FLASHINFER", False, sizes=(16, 32, 64), source="flashinfer.py",
                 kv_dtypes=(*_FP8_ANY, "nvfp4", "nvfp4_4over6"),
                 dtype_sm=(("nvfp4", (8, 9, 10, 12)), ("nvfp4_4over6", (10,)))),
    KernelBlocks("TRITON_ATTN", False, multiple_of=16, source="triton_attn.py",
                 kv_dtypes=(*_FP8_ANY, *_PER_TOKEN_HEAD)),
    KernelBlocks("FLEX_ATTENTION", False, multiple_of=16, fp8_sm=(), kv_dtypes=(),
                 source="flex_attention.py"),
    KernelBlocks("TURBOQUANT", False, sizes=(16, 32, 64, 128), source="turboquant_attn.py",
                 kv_dtypes=_TURBOQUANT, sixteen_bit=False),
    KernelBlocks("FLASH_ATTN_MLA", True, multiple_of=16, sm=(9,), fp8_sm=(), kv_dtypes=(),
                 source="mla/flashattn_mla.py"),
    KernelBlocks("FLASHMLA", True, sizes=(64,), sm=(9, 10), source="mla/flashmla.py"),
    KernelBlocks("FLASHINFER_MLA", True, sizes=(32, 64), sm=(10,),
                 source="mla/flashinfer_mla.py"),
    KernelBlocks("CUTLASS_MLA", True, sizes=(128,), sm=(10,), source="mla/cutlass_mla.py"),
    KernelBlocks("TRITON_MLA", True, multiple_of=16, source="mla/triton_mla.py"),
)}
# platforms/cuda.py `_get_backend_priorities` on SM80-SM90 (the GPUs kvtier profiles;
# Blackwell's order differs and is not modelled), dense (non-sparse) attention.
_PRIORITY = {
    False: ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT"),
    True: ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA"),
}
MODELLED_SM = (8, 9)


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The attention backend vLLM 0.33 uses for a block size, and what it does with it."""

    backend: KernelBlocks | None  # None: no backend takes the block size or dtype; vLLM refuses
    named: bool  # the operator named it (`--attention-backend`); False: vLLM's choice
    block_size: int  # the manager block size (`--block-size`, or vLLM's default)
    kernel_block: int | None  # the kernel block; < block_size: each block is split
    # Backends ahead of `backend` in vLLM's order that only the block size ruled out.
    precluded: tuple[str, ...] = ()
    kv_dtype: str = "auto"  # the `--kv-cache-dtype` (vLLM's name; "auto": 16-bit)
    # no backend (or not the named one) takes kv_dtype on this GPU: vLLM refuses to start
    dtype_refused: bool = False

    @property
    def splits(self) -> int:
        """Kernel blocks per manager block (1: no split; 0: no backend)."""
        return self.block_size // self.kernel_block if self.kernel_block else 0


def _runs(k: KernelBlocks, sm_major: int, mla: bool, kv_dtype: str) -> bool:
    return k.mla == mla and sm_major in k.sm and k.takes_dtype(kv_dtype, sm_major)


def vllm_kv_dtype(kv_dtype: str) -> str:
    """`kv_dtype` as vLLM names it: "auto" for any 16-bit name ("bf16" is kvtier's)."""
    return serve_flag_value(kv_dtype) or "auto"


def choose_backend(sm_major: int, mla: bool, kv_dtype: str, block_size: int | None = None,
                   named: str | None = None) -> BackendChoice | None:
    """What vLLM 0.33 picks on a CUDA GPU of compute capability `sm_major`.

    Args:
        mla: the model uses MLA.
        kv_dtype: `--kv-cache-dtype` ("auto", "bf16", "fp8", "nvfp4", ...): a backend runs
            only the dtypes it declares (a packed one is not FP8's: int8_per_token_head runs
            on Triton only, nvfp4 on FlashInfer, turboquant_* on TurboQuant).
        block_size: `--block-size`; None: vLLM's default for the backend it picks.
        named: `--attention-backend` (any case), None or "auto" for vLLM's choice.
    Returns:
        None when the choice is not modelled: a GPU outside MODELLED_SM, or a named backend
        not in CUDA_BACKENDS.
    """
    dtype = vllm_kv_dtype(kv_dtype)
    if named and named.lower() != "auto":
        backend = CUDA_BACKENDS.get(named.upper())
        if backend is None:
            return None
        size = block_size or backend.preferred_block()
        if not backend.takes_dtype(dtype, sm_major):
            return BackendChoice(None, True, size, None, (), dtype, dtype_refused=True)
        return BackendChoice(backend, True, size, backend.kernel_block(size), (), dtype)
    if sm_major not in MODELLED_SM:
        return None
    runnable = [CUDA_BACKENDS[n] for n in _PRIORITY[mla]
                if _runs(CUDA_BACKENDS[n], sm_major, mla, dtype)]
    if not runnable:
        return BackendChoice(None, False, block_size or DEFAULT_BLOCK_SIZE, None, (), dtype,
                             dtype_refused=True)
    if block_size is None:
        first = runnable[0]
        return BackendChoice(first, False, first.preferred_block(), first.preferred_block(),
                             (), dtype)
    precluded: list[str] = []
    for backend in runnable:
        if backend.accepts(block_size):
            return BackendChoice(backend, False, block_size, backend.kernel_block(block_size),
                                 tuple(precluded), dtype)
        precluded.append(backend.name)
    return BackendChoice(None, False, block_size, None, tuple(precluded), dtype)


def default_block_size(sm_major: int, mla: bool, kv_dtype: str,
                       named: str | None = None) -> int:
    """vLLM's block size on CUDA without `--block-size`: 16, or the smallest size the
    backend it picks takes (FlashMLA: 64)."""
    choice = choose_backend(sm_major, mla, kv_dtype, None, named)
    return choice.block_size if choice is not None else DEFAULT_BLOCK_SIZE


def long_context_block(sm_major: int, mla: bool, kv_dtype: str, wanted: int = 32) -> int:
    """`wanted` (the operator's guide's --block-size 32 for long contexts), or the backend's
    own block size when that is larger: 32 would rule FlashMLA (64 only) out for TRITON_MLA."""
    choice = choose_backend(sm_major, mla, kv_dtype)
    if choice is None or choice.backend is None or choice.backend.accepts(wanted):
        return wanted
    return max(wanted, choice.backend.preferred_block())


def describe_choice(choice: BackendChoice) -> str:
    """One line: the backend, the kernel blocks it takes, and the kernel block it uses."""
    if choice.dtype_refused:
        which = "the named backend" if choice.named else "no attention backend"
        return (f"{which} takes --kv-cache-dtype {choice.kv_dtype} on this GPU: vLLM "
                "refuses to start")
    if choice.backend is None:
        return f"no backend takes block size {choice.block_size}: vLLM refuses to start"
    head = f"{choice.backend.name} (takes {choice.backend.describe()})"
    if choice.precluded:
        head += f", as block {choice.block_size} rules out {', '.join(choice.precluded)}"
    if choice.kernel_block is None:
        return f"{head}: block {choice.block_size} is not one it takes; vLLM refuses to start"
    split = "no split" if choice.splits == 1 else f"each block split in {choice.splits}"
    return f"{head}: block {choice.block_size} -> kernel block {choice.kernel_block} ({split})"
