"""Where jobs run besides the server's own host: the Slurm backend (:mod:`.slurm`)."""
