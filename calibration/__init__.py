"""Calibration: fitting simulator Profiles from microbenchmarks and profiler traces (issue 6)."""
