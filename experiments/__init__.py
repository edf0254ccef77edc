"""Experiments: measurements and studies built on hidup, the simulator and calibration."""
