"""The load tool (`epd-serve bench`): AISBench-style runs against any OpenAI-compatible
endpoint, rate sweeps, goodput search, deployment comparison, reports."""
