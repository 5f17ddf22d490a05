"""The search for a plan: the heuristic (candidate multisets, LPT, local search, resize moves),
the intra-step checkpoint policy choice, and CP-SAT."""
