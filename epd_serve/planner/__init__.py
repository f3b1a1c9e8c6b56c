"""Choosing a deployment for a workload and an SLO: budgets, costs, a simulator, the planner.

Stage budgets (budgets.py), measured or published per-stage costs (profile.py,
profiler.py), a discrete-event simulator of a deployment (simulator.py, with the proxy's
role switching in switching.py and what it buys under a shifting workload in
role_shift.py) and the planner that compares candidate deployments (planner.py);
verify.py runs the winners for real.
"""
