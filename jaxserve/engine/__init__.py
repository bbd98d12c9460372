"""The engine: ``LLMEngine`` (one step at a time: schedule, run, build outputs), its KV budget,
incremental detokenisation, metrics, the asyncio wrapper the server uses and data parallelism."""
