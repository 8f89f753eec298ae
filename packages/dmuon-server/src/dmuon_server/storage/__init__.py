"""What the server keeps: the SQLite store, its typed rows, the data directory and the jobs'
files."""
