"""A clock that a test moves by hand, for the rules that count time (TTLs, quotas' days, stalls): handed to
the object that owns the rule in place of time.time or time.monotonic, so no test sleeps for time to pass."""


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
