"""The embedded server's routes, one APIRouter per concern:

- `completions`: POST /v1/completions and /v1/chat/completions (streamed too)
- `models`: GET /v1/models and vLLM's LoRA admin routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
- `health`: GET /health and GET /metrics (Prometheus)
- `extensions`: mint's own routes under /v1/mint/ (prefetch)
"""
