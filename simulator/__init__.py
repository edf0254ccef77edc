"""The SimPy simulator: times a HiDup Program on a cluster described by a Profile."""
from simulator.engine import Record, Result, SimulationError, simulate
from hidup.profile import LinkCost, Profile, ProfileError, load_profile

__all__ = ["LinkCost", "Profile", "ProfileError", "Record", "Result", "SimulationError",
           "load_profile", "simulate"]
