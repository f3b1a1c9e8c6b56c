"""Our EC connector: encoder features through the MM Store (epd_serve/mmstore).

Load it in vLLM with `"ec_connector": "EPDECConnector",
"ec_connector_module_path": "epd_serve.connectors.epd_ec"`. The facade is
connector.py; scheduler.py and worker.py are its two sides, loader.py reads a
consumer's features (hinted or asked for) into its memory before they are promised,
codec.py turns tensors to bytes and back, stats.py keeps its metrics. An instance runs
as ec_producer (encoder), ec_consumer (prefill, decode) or ec_both (either, request by
request: scheduler.py). Imported lazily, so the control plane can read `settings`
without vLLM installed.
"""


def __getattr__(name: str):
    if name == "EPDECConnector":
        from epd_serve.connectors.epd_ec.connector import EPDECConnector

        return EPDECConnector
    raise AttributeError(name)
