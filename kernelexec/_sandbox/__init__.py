"""The mechanisms behind isolation levels and limits: cgroups, rlimits, the reaping launcher,
the bubblewrap command line and per-kernel users (private; used by the local backend)."""
