"""What the KV bytes of one chunk are: the layout descriptor and its stable digest.

A chunk holds the K and V of `tokens_per_chunk` consecutive tokens, for every layer, for the
KV heads of one tensor-parallel rank. The layout digest namespaces every stored chunk, so KV of
another model shape, dtype or parallel layout can never be served by mistake. With the model's
fingerprint set (`model_fingerprint`, the connector sets it: core/fingerprint.py) the digest
also names the model, so each checkpoint's chunks live in a storage namespace of their own
(ROOT/<digest>/, <prefix><digest>:) that `kvtier inspect` shows and `kvtier gc` evicts whole.

Primitives: `KVLayout`, `DTYPE_BYTES`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import blake3

from kvtier.errors import ConfigError

# Bytes per element of the KV dtypes engines use (torch-style names).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of the KV that one chunk holds. Validated on construction."""

    num_layers: int  # attention layers that keep per-token KV
    num_kv_heads: int  # KV heads held by THIS tensor-parallel rank
    head_size: int  # elements per head (for MLA: the latent + rope width)
    dtype: str  # element type, a key of DTYPE_BYTES
    tokens_per_chunk: int  # tokens per stored chunk (a multiple of the engine's block size)
    tp_rank: int = 0  # this rank's index in its tensor-parallel group
    tp_world_size: int = 1  # tensor-parallel group size
    kv_factor: int = 2  # 2 for separate K and V; 1 for MLA's single latent
    # The served model's fingerprint (ModelFingerprint.digest, 32 hex digits); "" for none
    # (benches, tests): left out of the digest's text, so it changes no existing digest.
    model_fingerprint: str = ""
    # Bytes after a chunk's KV: the recurrent state at its end, of models with Mamba/conv
    # layers (integrations/vllm/groups.py); 0: none (left out of the digest's text too).
    state_bytes: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_size", "tokens_per_chunk",
                      "tp_world_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout.{field}", value, "a positive integer")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("layout.dtype", self.dtype, f"one of {sorted(DTYPE_BYTES)}")
        # tp_rank and kv_factor must be ints too: "0" would raise TypeError here, and 2.0
        # would pass, giving a layout equal to kv_factor=2 with another digest (its text is
        # "kv_factor=2.0"), so its chunks would never be found (tests/cache/test_layout.py).
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_world_size:
            raise ConfigError("layout.tp_rank", self.tp_rank,
                              f"0 <= tp_rank < {self.tp_world_size}")
        if not isinstance(self.kv_factor, int) or self.kv_factor not in (1, 2):
            raise ConfigError("layout.kv_factor", self.kv_factor, "1 (MLA) or 2 (K and V)")
        if not isinstance(self.state_bytes, int) or self.state_bytes < 0:
            raise ConfigError("layout.state_bytes", self.state_bytes, "an integer >= 0")
        if not isinstance(self.model_fingerprint, str) or not (
                self.model_fingerprint == "" or _FINGERPRINT.fullmatch(self.model_fingerprint)):
            raise ConfigError("layout.model_fingerprint", self.model_fingerprint,
                              "'' or 32 lowercase hex digits (a ModelFingerprint.digest)")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank, over all layers."""
        return (
            self.kv_factor * self.num_layers * self.num_kv_heads * self.head_size
            * DTYPE_BYTES[self.dtype]
        )

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one full chunk on this rank: its KV, and its state region if any."""
        return self.bytes_per_token * self.tokens_per_chunk + self.state_bytes

    def digest(self) -> str:
        """A 32-hex-digit digest of every field (`model_fingerprint` only when set); equal
        layouts have equal digests everywhere."""
        fields = asdict(self)
        for name in ("model_fingerprint", "state_bytes"):
            if not fields[name]:
                del fields[name]  # the digests of layouts made before they existed
        text = ";".join(f"{k}={v}" for k, v in sorted(fields.items()))
        return blake3.blake3(text.encode()).hexdigest(length=16)
