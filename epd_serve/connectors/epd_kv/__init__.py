"""Our layer-grouped asynchronous KV connector (prefill pushes into decode's memory).

Load it in vLLM with `"kv_connector": "EPDKVConnector",
"kv_connector_module_path": "epd_serve.connectors.epd_kv"`. The facade is
connector.py; scheduler.py and worker.py are its two sides (the worker's prefill
side: sender.py, one sender_*.py per thread around sender_table.py; its decode side:
receiver.py), messages.py what they say, layout.py / grouping.py / transfer.py / drain.py /
channel.py the pieces they use. An instance runs as kv_producer (prefill: sends),
kv_consumer (decode: receives) or kv_both (either, request by request, so that the
proxy can switch it between prefill and decode by routing alone; its workers run a
sender and a receiver). The facade (and with it vLLM) is imported on first access, so
the control plane can read `settings` without vLLM installed.
"""


def __getattr__(name: str):
    if name == "EPDKVConnector":
        from epd_serve.connectors.epd_kv.connector import EPDKVConnector

        return EPDKVConnector
    raise AttributeError(name)
