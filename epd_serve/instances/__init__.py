"""Running instances seen from outside: the requests we send them, the counters and logs they report."""
