"""Verify: the prediction checked against reality: a running job's measured peak, measured runs and published figures.

In: an estimate and measurements. Out: a comparison per row, with the error in percent.
"""
