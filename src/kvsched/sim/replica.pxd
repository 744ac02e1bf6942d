# Cython's declarations for replica.py (the compiled build, kvsched/compiled.py): attributes as
# C struct fields and the batch's methods as C calls, so compiled code reads and calls them
# without a dict lookup. `object` fields keep Python's numbers exactly.
cimport cython

from kvsched.kvcache cimport PagedKV
from kvsched.metrics cimport GapHistogram
from kvsched.sim.decode_set cimport Cohort, DecodeSet
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
    cdef public object runs_ahead, _decode_time, _face, view

    cpdef next_event_time(self)
    cpdef accept(self, i, t)
    cpdef _arrived(self, t, prefill_tokens)
    cpdef step(self, until=*)
    cpdef _idle_fits(self)
    cpdef _decode_run(self, until)
    cpdef _plain_decodes(self, Cohort c, double until)
    cpdef _end_run(self, k0, k, kv_integral, busy, peak, now)
    cpdef _spill_logs(self)
    cpdef _write_back(self, Cohort c, clock, ctx, now, allocated, used)
    cpdef _batch_end(self, start, dt)
    cpdef _execute(self, plan)
    cpdef _prefill_shape(self, chunks, decode_blocks=*)
    cpdef _allocate(self, n)
    cpdef _free(self, i, kv_tokens, done)
    cpdef _free_finished(self)
    cpdef _stalled(self, end)
    cpdef _selected(self, d)
    cpdef _admit(self, i)
    cpdef _decode_step(self, end, cohorts)
    cpdef _first_gaps(self, Cohort ch, end)
    cpdef _tier_first_gaps(self, end, cohorts)
    cpdef _fold(self, i, gen, last, window)
    cpdef _leave_decode(self, i)
    cpdef _move(self, i, Cohort src, Cohort dst)
    cpdef _prefill_complete(self, i, t)
    cpdef _land_ready(self)
    cpdef _finish(self, i, t, kv_tokens)
    cpdef _preempt(self, i)
