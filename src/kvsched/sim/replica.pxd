# Cython's declarations for replica.py (the compiled build, kvsched/compiled.py): the replica's
# state as C struct fields, which its owners (lifecycle, kv_blocks, batch, decode_run, records)
# read and write without a dict lookup, and its step API as C calls. `object` fields keep
# Python's numbers exactly.
cimport cython

from kvsched.kvcache cimport PagedKV
from kvsched.metrics cimport GapHistogram
from kvsched.sim.decode_set cimport DecodeSet
from kvsched.sim.requests cimport RequestTable


@cython.final
cdef class Replica:
    cdef public RequestTable reqs
    cdef public PagedKV kv
    cdef public DecodeSet _decoders
    cdef public GapHistogram itl
    cdef public object policy, cost, index, role, name, block_size, kv_capacity_blocks, _arrivals, _handoff
    cdef public object _on_done, _stall_limit, _stall, _queue, _landing, pulls, cache, _admissions
    cdef public dict _running, _prefilling, _order, _where
    cdef public set _fresh
    cdef public list _finishing, _arrival, _prompt, _output, _known, _target, _computed, _status
    cdef public object tier_itl, now, iterations, _last_kind, busy, kv_integral, peak_kv, peak_queue
    cdef public object preemptions, outstanding, prefill_backlog, _blocked, _snap, track_start
    cdef public object recent_batch_times, recent_finished, timeline, batches, _schedule, _on_finish
    cdef public object _on_preempt, _on_batch_end, _plan_hooks, _steady
    cdef public object runs_ahead, _decode_time, _dense_time, _face, view, _swap, _offload, _side, _planner, _spec

    cpdef next_event_time(self)
    cpdef accept(self, i, t)
    cpdef _arrived(self, t, prefill_tokens)
    cpdef step(self, double until=*)
    cpdef prefix_planner(self)
    cpdef bint awaits_hit(self, i)
    cpdef _call(self, fn, where, i)
