"""Where jobs run: the local host (:mod:`.local`) or a Slurm cluster (:mod:`.slurm_jobs`),
behind one interface (:class:`.protocol.Launcher`) the supervisor schedules over.

:func:`launcher_for` builds the one the settings name; the app gives it to the supervisor
(tests give it one of their own)."""

from __future__ import annotations

from dmuon_server.config import Settings
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.launching.protocol import Launcher, Move
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import Hub, MetricsTailer


def launcher_for(
    settings: Settings,
    store: Store,
    hub: Hub,
    tailer: MetricsTailer,
    move: Move,
    identities: JobIdentities,
) -> Launcher:
    """The launcher ``settings.launcher`` names: Slurm's or the local host's."""
    if settings.launcher == "slurm":
        from dmuon_server.launching.slurm_jobs import SlurmLauncher

        return SlurmLauncher(settings, store, hub, tailer, move, identities)
    from dmuon_server.launching.local import LocalLauncher

    return LocalLauncher(settings, store, hub, tailer, move, identities)
