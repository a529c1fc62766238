"""The simulator's cost model: seconds per engine step and per tier load, as plain numbers.

The model and hardware math lives in `kvtier.tools.ops` (modelspec: KV bytes per token and
parameter counts from a config.json; hardware: GPU, PCIe, NVMe, DRAM profiles; costmodel:
prefill FLOPs). This module folds those into a handful of floats once, so that the event
loop's hot path does arithmetic, not attribute walks over specs.

Primitives:
    MODEL_PRESETS                 -- config.json excerpts of models used in examples
    model_spec(name_or_path)      -- a preset name or a path to a config.json
    CostModel                     -- frozen plain-number cost model of one engine
    build_cost_model(...)         -- CostModel from a ModelSpec and a GPU profile

Step time is a roofline: `overhead + max(FLOPs / (peak * mfu), bytes / (hbm * eff))` per
tensor-parallel rank, where FLOPs are matmuls (2 x non-embedding params per token) plus
causal attention pairs, and bytes are the weight shard plus the KV every sequence reads.
Sliding-window layers are costed as full attention (an upper bound; noted for later).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tools.ops.costmodel import DECODE_BANDWIDTH_EFFICIENCY
from kvtier.tools.ops.hardware import PREFILL_MFU, GpuProfile, host_link
from kvtier.tools.ops.modelspec import ModelSpec, kv_footprint, load_model_spec, parse_model_config

_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "rope_theta": 500000.0,
            "torch_dtype": "bfloat16", "max_position_embeddings": 131072, "head_dim": 128}
# Public config.json values (meta-llama/Llama-3.1-*-Instruct, Qwen/Qwen2.5-32B-Instruct).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "tie_word_embeddings": False},
    "llama-3.1-70b": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen2.5-32b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
                    "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8,
                    "torch_dtype": "bfloat16", "max_position_embeddings": 32768,
                    "tie_word_embeddings": False},
}
# Per engine step: Python scheduling, input preparation, CUDA-graph launch. vLLM V1 hides
# part of it with async scheduling; 1.5 ms is a typical un-hidden remainder on an H100 host.
STEP_OVERHEAD_S = 1.5e-3
# Activation and CUDA-graph memory vLLM's profiler keeps out of the KV pool, per rank.
ACTIVATION_RESERVE_BYTES = 2 * 1024**3


def model_spec(name_or_path: str) -> ModelSpec:
    """Return the ModelSpec of a preset (`MODEL_PRESETS`) or of a config.json path.

    Raises:
        ConfigError: neither a preset nor a readable config.json.
    """
    key = name_or_path.strip().lower()
    if key in MODEL_PRESETS:
        return parse_model_config(MODEL_PRESETS[key], name=key)
    try:
        exists = Path(name_or_path).exists()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL byte
        exists = False
    if exists:
        return load_model_spec(name_or_path)
    raise ConfigError("model", name_or_path,
                      f"a preset ({', '.join(MODEL_PRESETS)}) or a path to a config.json")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Everything the engine needs to price a step or a transfer, per tensor-parallel rank."""

    name: str  # "<model> on <tp>x <gpu>", for reports
    dense_flops_per_token: float  # 2 x non-embedding active params
    attn_flops_per_pair: float  # FLOPs per (query, key) pair summed over attention layers
    flops_per_s: float  # achieved FLOP/s of one rank (peak x mfu)
    weight_bytes_per_rank: float  # weight shard read once per step
    kv_bytes_per_token_rank: float  # KV one rank holds (and reads) per token
    kv_bytes_per_token: float  # KV of the whole instance per token: what tiers store
    hbm_bytes_per_s: float  # achieved HBM bandwidth of one rank
    link_gbps: float  # host<->device bandwidth of the instance (tp links in parallel)
    step_overhead_s: float  # fixed CPU-side cost of every engine step
    tp: int  # tensor-parallel ranks
    hbm_bytes_per_rank: int  # device memory of one rank
    reserve_bytes_per_rank: int  # activations etc., kept out of the KV pool

    def step_s(self, new_tokens: int, attn_pairs: float, kv_tokens_read: float) -> float:
        """Seconds for one step computing `new_tokens` (prefill chunks + one per decode).

        Args:
            attn_pairs: causal (query, key) pairs of the step's attention, all sequences.
            kv_tokens_read: context tokens whose KV the step reads (sum over sequences).
        """
        compute = (self.dense_flops_per_token * new_tokens
                   + self.attn_flops_per_pair * attn_pairs) / self.flops_per_s
        memory = (self.weight_bytes_per_rank
                  + self.kv_bytes_per_token_rank * kv_tokens_read) / self.hbm_bytes_per_s
        return self.step_overhead_s + (compute if compute > memory else memory)

    def prefill_s(self, start: int, end: int) -> float:
        """Compute seconds to prefill prompt tokens start..end (causal attention over the
        tokens before each): what recomputing them costs, without step overheads."""
        n = end - start
        pairs = n * (start + end + 1) / 2
        flops = self.dense_flops_per_token * n + self.attn_flops_per_pair * pairs
        return flops / self.flops_per_s

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """Seconds for one pure decode step of `batch` sequences holding `context_tokens`."""
        return self.step_s(batch, context_tokens, context_tokens)

    def kv_capacity_tokens(self, gpu_memory_utilization: float) -> int:
        """Tokens of KV the GPU pool holds at `gpu_memory_utilization` (vLLM's meaning).

        Raises:
            ConfigError: when the weights and reserve leave no room for KV.
        """
        free = (self.hbm_bytes_per_rank * gpu_memory_utilization
                - self.weight_bytes_per_rank - self.reserve_bytes_per_rank)
        if free <= 0:
            raise ConfigError("gpu_memory_utilization", gpu_memory_utilization,
                              f"a value that leaves room for KV after the weights of {self.name}")
        return int(free // self.kv_bytes_per_token_rank)


def build_cost_model(
    spec: ModelSpec, gpu: GpuProfile, tp: int = 1, *, kv_dtype: str = "bf16",
    mfu: float = PREFILL_MFU, step_overhead_s: float = STEP_OVERHEAD_S,
    link_gbps: float | None = None,
) -> CostModel:
    """Fold a model and a GPU profile into a CostModel.

    Args:
        link_gbps: per-rank host link bandwidth; default: the GPU's PCIe profile.
    Raises:
        ConfigError: tp < 1, mfu outside (0, 1], negative overhead, unknown kv_dtype.
    """
    if not 0 < mfu <= 1:
        raise ConfigError("mfu", mfu, "a fraction in (0, 1]")
    if step_overhead_s < 0:
        raise ConfigError("step_overhead_s", step_overhead_s, "seconds >= 0")
    fp = kv_footprint(spec, kv_dtype, tp, hybrid_manager=False)
    if spec.mla is not None:
        mla = spec.mla
        pair = 2.0 * spec.num_attention_heads * (
            mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    else:
        pair = 4.0 * spec.num_attention_heads * spec.head_dim
    attn_layers = spec.count("full") + spec.count("sliding")
    link = link_gbps if link_gbps is not None else host_link(gpu).bandwidth_gbps
    return CostModel(
        name=f"{spec.name} on {tp}x {gpu.name}",
        dense_flops_per_token=2.0 * (spec.active_param_count - spec.embedding_param_count) / tp,
        attn_flops_per_pair=pair * attn_layers / tp,
        flops_per_s=gpu.bf16_tflops * 1e12 * mfu,
        weight_bytes_per_rank=spec.weights_bytes / tp,
        kv_bytes_per_token_rank=float(fp.bytes_per_token),
        kv_bytes_per_token=float(fp.bytes_per_token * tp),
        hbm_bytes_per_s=gpu.hbm_bandwidth_gbps * 1e9 * DECODE_BANDWIDTH_EFFICIENCY,
        link_gbps=link * tp,
        step_overhead_s=step_overhead_s,
        tp=tp,
        hbm_bytes_per_rank=gpu.hbm_bytes,
        reserve_bytes_per_rank=ACTIVATION_RESERVE_BYTES,
    )
