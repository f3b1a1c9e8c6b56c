"""Choosing a deployment: stage budgets (budgets.py), measured or published per-stage
costs (profile.py, profiler.py), a discrete-event simulator of a deployment
(simulator.py) and the planner that compares candidate deployments (planner.py)."""
