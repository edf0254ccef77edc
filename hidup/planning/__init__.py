"""Strategies, the search and its cost model: `strategy` (fixed strategies, propagation,
summaries), `planfile` (versioned plan files), `search` (the paper's dynamic programme),
`estimate` (a one-pass replay of a Program), `memory` (peak memory of a Program) and `costs`
(a cluster's cost figures, the Profile, and the cost model that times tasks with them)."""
