"""What runs the solves: settings, tasks and outcomes, the front, the stores, the two
executors and their workers. This imports nothing, so that a worker process importing
one module here loads nothing else."""
