"""The load tool (`epd-serve bench`): runs, rate sweeps, goodput search, comparisons, reports.

AISBench-style, against any OpenAI-compatible endpoint; also the shared search for the
largest rate that passes (bench/search.py), which the planner uses too.
"""
