"""Running a Program for real: `step` traces one rank's step into an FX graph, `passes`
simplifies and compiles it, `execute` runs it; `data` (batches), `checkpoint` (saving and
resuming) and `launch` (starting a command's ranks on this machine) serve `hidup.train`."""
