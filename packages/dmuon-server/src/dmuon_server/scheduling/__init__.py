"""Scheduling: which queued job starts when (queue policy, GPUs), the supervisor thread, and
the one way a job changes state."""
