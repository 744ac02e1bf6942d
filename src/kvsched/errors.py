"""User-facing errors: the CLI prints these as one line and exits with code 2."""


class KvschedError(Exception):
    """Bad input or impossible configuration, reported to the user without a traceback."""


class PlanError(KvschedError):
    """A scheduling policy returned an illegal plan (names the policy)."""


# what user code (a policy, a router, a cost model, a plugin) raises stops the run with one error
# naming it, whatever it is (SystemExit included: user code calling sys.exit must not end
# kvsched silently), except these: Ctrl-C still interrupts, and running out of memory is the
# machine's, not the code's
PASS_THROUGH = (KeyboardInterrupt, MemoryError)
