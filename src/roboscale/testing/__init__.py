"""What roboscale's tests and benchmarks build on that users can run too: ``cluster``, hosts on one machine."""
