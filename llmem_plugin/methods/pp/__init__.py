"""Pipeline parallelism: torch's ``torch.distributed.pipelining`` schedules, every rank traced or composed.

In: a model, workload and layout with a pipeline degree. Out: a MethodEstimate per rank; ``method.py`` is the method, ``rank`` traces, composes or extrapolates one rank, ``schedule``/``split``/``stage`` run a rank, ``compose``/``synth`` build ranks from short runs.
"""
