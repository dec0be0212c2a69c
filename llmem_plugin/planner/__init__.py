"""Planner: the fastest distributed method that fits, found in named steps, with a step-time model.

In: a model, a workload and a cluster. Out: a Plan (the choice, the ranked candidates, why) or WontFitError with the report and what would make it fit.
"""
