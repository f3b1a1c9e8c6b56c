"""Running a deployment: one start-up plan, carried out by local processes, Ray actors or a script."""
