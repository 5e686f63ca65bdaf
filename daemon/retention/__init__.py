"""What is kept: the pure retention planner, per-job rules, the janitor that applies them, the free-space floor."""
