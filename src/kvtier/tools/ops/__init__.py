"""Operator tooling logic (no CLI): the math and checks behind `kvtier plan/audit/doctor`.

Modules:
    modelspec   -- HF config.json -> ModelSpec; KV bytes per token (MHA/GQA/MLA, sliding,
                   linear/Mamba state), per TP rank
    modelparams -- parameter counts (dense, MoE, MLA, linear mixers) and recurrent state size
    hardware    -- GPU profiles (H100/H200/A100/L40S/local CPU) and link bandwidths
    costmodel   -- prefill FLOPs/seconds, decode step time, transfer time
    vllm_versions -- version gates and the hybrid-KV-manager decision
    flags       -- serve flags/env for kvtier, vLLM native offload and LMCache
    cores       -- each CPU engine started beside others its own cores
    sizing      -- the plan
    audit/      -- `vllm serve` parser, findings, rule registry, rules_*.py
    doctor      -- installation checks
"""
