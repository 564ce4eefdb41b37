"""A worker that generates through vLLM's OpenAI server instead of our engine.

`tokenmill worker --engine vllm` is the same worker toward the fleet (/generate, /metrics,
/ready, adapters, heartbeats, KV events, draining, the internal token) in front of a vLLM
server, for what outgrows our engine: several GPUs per replica, other architectures,
quantized weights.

- `server`: the vLLM server: started as a child process with the flags that make it one of
  ours (block size, prompt token details, KV events), or reached at TOKENMILL_VLLM_URL;
- `generator`: `VllmGenerator`, the `workers.server.Generator` the worker's app serves;
- `metrics`: load figures polled from vLLM's own /metrics, for heartbeats and ours;
- `lora`: LoRA adapters from our storage, through vLLM's runtime adapter endpoints;
- `kv_events`: vLLM's KV events (ZMQ) mapped to our salted block hashes;
- `worker`: the parts assembled from the settings, for `workers.main.run_worker`.
"""
