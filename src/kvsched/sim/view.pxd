# Cython's declarations for view.py (the compiled build, kvsched/compiled.py): the type of the
# replica its reads hold (`@cython.locals(r="Replica")`), so they read its fields directly.
from kvsched.sim.decode_set cimport Cohort
from kvsched.sim.replica cimport Replica
