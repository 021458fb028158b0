"""What keeps a run alive or stops it cleanly: the non-finite guard, preemption signals, collective timeouts and
heartbeats (comm_watch), torchft replica groups."""
