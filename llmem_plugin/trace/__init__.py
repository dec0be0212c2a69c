"""Trace: run the model's own training step under fake tensors and record every allocation and free.

In: a built model and a Workload. Out: a TraceResult (the event stream with phases and categories); fast mode and stream synthesis build the full depth's stream from a few layers.
"""
