"""The core: executor, sessions, kernel leases and budget, warm pools, the run loop, outputs."""
