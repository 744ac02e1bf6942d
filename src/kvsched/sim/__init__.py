"""Simulation: the replica loop and its decode-set machinery."""
# The replica first: its owners (lifecycle, kv_blocks, batch, decode_run, records) are compiled
# against its type and each other's functions, and import in a cycle only it starts cleanly
# (whichever of them runs as Python: kvsched/compiled.py's Guard).
import kvsched.sim.replica  # noqa: F401
from kvsched.sim.server import Server

__all__ = ["Server"]
