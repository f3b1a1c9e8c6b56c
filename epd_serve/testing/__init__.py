"""Test doubles: a fake OpenAI-compatible engine server (needs the [dev] extra: FastAPI, uvicorn)."""
