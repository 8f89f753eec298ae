"""Where jobs run: the local host (:mod:`.local`) or a Slurm cluster (:mod:`.slurm_jobs`),
behind one interface (:class:`.base.Launcher`) the supervisor schedules over."""
