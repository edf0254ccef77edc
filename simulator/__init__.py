"""The SimPy simulator: times a HiDup Program on a cluster described by a Profile."""
from hidup.planning.costs import LinkCost, Profile, ProfileError
from hidup.planning.profile_file import load_profile
from simulator.engine import simulate
from simulator.records import Record, Result, SimulationError

__all__ = ["LinkCost", "Profile", "ProfileError", "Record", "Result", "SimulationError",
           "load_profile", "simulate"]
