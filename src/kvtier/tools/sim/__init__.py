"""`kvtier simulate`: a discrete-event simulator of serving engines with kvtier's tiers.

Modules, in the order data flows through them:
    workload  -- seeded synthetic traffic (sessions, shared prompts, history, documents)
    cost      -- step and transfer times from model FLOPs and bandwidths (via kvtier.tools.ops)
    kvcache   -- the GPU's paged KV pool with a prefix cache over block hashes
    tiers     -- offload tiers: capacity, bandwidth, LRU/ARC eviction (kvtier.core.policies)
    engine    -- one engine: continuous batching, chunked prefill, preemption, tier loads
                 (load_when: a hit loaded only as far as it beats recompute, or always)
    fleet     -- SimConfig and simulate(): engines behind a router, in time order
    report    -- counters and the SimReport (throughput, TTFT p50/p99, hit rate per tier)
    sweep     -- one parameter swept with and without offload; where offload pays
    plot      -- PNG of a sweep
    burst     -- a burst of long prompts from one slow tier: recompute, naive, the rule
    validate  -- the model against published figures
  and, for `kvtier simulate --trace` (a request trace through the policies alone, no engine):
    trace     -- Mooncake and generic JSONL traces as chains of block keys
    replay    -- one policy (kvtier.core.policies, as a tier drives it) at one capacity
    optimum   -- the ceilings: Belady's MIN with the prefix constraint, and unbounded
    tracesweep -- policies x capacities beside the optimum (plot.plot_trace draws it)
"""
