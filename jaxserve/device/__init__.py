"""How one step runs on the device: token/sequence buckets, the model runner (one jitted program
per bucket), the sampler, the host tier for evicted KV blocks and the 8-bit KV calibration."""
