"""Simulation: the replica loop and its decode-set machinery."""
from kvsched.sim.server import Server

__all__ = ["Server"]
