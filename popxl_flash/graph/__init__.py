"""PopXL graph code: block helpers (`blocks`), runtime segment masks (`segments`), score
modifiers and dropout (`score_mods`), the forward and backward modules (`module`, `forward`,
`backward`) and `reachable` (the graphs a graph calls). Imports `plan` and the backend only."""
