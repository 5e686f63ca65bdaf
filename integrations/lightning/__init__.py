"""Lightning ``CheckpointIO`` plug-in for ckptstage (being written)."""
