"""Process helpers of the plumbing: is a process alive (the store's staging sweep, the MLflow
orphan reaper). The runtime's state directory needs the same check (its budget ledger reaps the
reservations of killed processes), so it lives there: :func:`kibidango.paid.state.pid_alive`."""

from __future__ import annotations

from kibidango.paid.state import pid_alive

__all__ = ["pid_alive"]
