"""Connectors loaded into vLLM engine processes through `*_connector_module_path`.

Each module here is imported inside the vLLM API server, engine core and worker
processes; they may import vLLM and torch, and of epd_serve only this package and those
below it (protocols: the parameters they read; mmstore: the feature store), and must not
touch a device at import time.
"""
