"""epd-serve: Encode-Prefill-Decode disaggregated serving for multimodal LLMs."""

__version__ = "0.1.0"
