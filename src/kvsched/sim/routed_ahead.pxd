# Cython's declarations for routed_ahead.py (the compiled build, kvsched/compiled.py): the types
# its loop's locals hold, so it reads the replica's and the tables' fields without a dict lookup.
from kvsched.sim.replica cimport Replica
from kvsched.sim.requests cimport RequestTable
