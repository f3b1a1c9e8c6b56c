"""Connectors loaded into vLLM engine processes through `*_connector_module_path`.

Each module here is imported inside the vLLM API server, engine core and worker
processes; they may import vLLM and torch, but nothing else of epd_serve beyond this
package, and must not touch a device at import time.
"""
