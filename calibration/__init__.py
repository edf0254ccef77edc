"""Calibration: reading real profiler traces (calibration/trace.py) and, next, fitting simulator
Profiles from them and from microbenchmarks on the user's cluster."""
