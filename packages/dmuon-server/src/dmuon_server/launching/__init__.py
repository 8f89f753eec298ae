"""Where and how jobs run: the launcher interface, the local host, Slurm, the command line,
the Unix account and the sandbox."""
