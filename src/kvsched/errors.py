"""User-facing errors: the CLI prints these as one line and exits with code 2."""


class KvschedError(Exception):
    """Bad input or impossible configuration, reported to the user without a traceback."""


class PlanError(KvschedError):
    """A scheduling policy returned an illegal plan (names the policy)."""
