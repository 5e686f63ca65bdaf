"""Local to shared: the drain queue and its copies, prefetches back, the shared tier's index kept fresh, the drain on stop."""
