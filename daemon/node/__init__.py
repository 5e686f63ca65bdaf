"""The node: the domain object that wires the stages, and its answers (status, jobs, listings, incomplete steps)."""
