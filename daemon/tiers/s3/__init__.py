"""The shared tier on an S3-compatible object store: one implementation of the tier interface."""
