"""Test doubles and test rigs: a fake OpenAI-compatible engine server (needs the [dev]
extra: FastAPI, uvicorn), and a second proxy in front of a running deployment (for
trying a proxy setting on the same engines: tests and benchmarks)."""
