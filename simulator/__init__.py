"""The SimPy simulator: times a HiDup Program on a cluster described by a Profile."""
from hidup.planning.costs import LinkCost, Profile, ProfileError, load_profile
from simulator.engine import Record, Result, SimulationError, simulate

__all__ = ["LinkCost", "Profile", "ProfileError", "Record", "Result", "SimulationError",
           "load_profile", "simulate"]
