# Cython's declarations for cluster.py (the compiled build, kvsched/compiled.py): the types
# its loop's locals hold, so it reads the replicas' fields without a dict lookup.
from kvsched.sim.replica cimport Replica
from kvsched.sim.requests cimport RequestTable
